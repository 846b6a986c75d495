/* client_int.h - what the files of libkvferry share inside the library:
 * finding the file behind host memory (libkvferry_mem.c) and the tables
 * that keep pool and layout ids stable across a daemon restart
 * (libkvferry_ids.c). Nothing here is exported (libkvferry.map). */
#ifndef KVF_CLIENT_INT_H
#define KVF_CLIENT_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* An id the current daemon does not know (a pool that did not come back
 * after a restart, memory it refused): the daemon answers KVF_ENOPOOL /
 * KVF_ENOENT when it is used. */
#define KVF__NO_ID UINT32_MAX

/* The file backing host memory [addr, addr + size): one MAP_SHARED mapping
 * of one file, found in /proc/self/maps. *fd is a new descriptor of that
 * file, opened read-write (from an fd this process holds on it, or by path
 * on tmpfs / hugetlbfs), owned by the caller; *offset is the file offset
 * of addr. KVF_EINVAL: anonymous or private memory, memory in several
 * mappings, or a file with no descriptor or path this process can open. */
int kvf__host_mem_fd(const void *addr, uint64_t size, int *fd, uint64_t *offset);

/* ------------------------------------------------------------ id tables
 *
 * Engines hold pool and layout ids; a daemon that restarts may give the
 * same pool or layout a different id. Each table maps the id the engine
 * holds (vid) to the current daemon's (did). A vid is the did it was first
 * learned as, unless another entry holds that number already; ids the
 * library never learned pass unchanged. Not thread-safe: the client's mu
 * guards them. */
typedef struct kvf__idrec {
  uint32_t vid, did;
  char name[64];   /* pools: the name they are found by after a restart */
  void *data;      /* engine memory or a layout's copy; owned by the client */
} kvf__idrec;

typedef struct kvf__ids {
  kvf__idrec *v;
  size_t n, cap;
} kvf__ids;

kvf__idrec *kvf__ids_by_vid(kvf__ids *t, uint32_t vid);
kvf__idrec *kvf__ids_by_did(kvf__ids *t, uint32_t did);
kvf__idrec *kvf__ids_by_name(kvf__ids *t, const char *name);
/* A new entry for did (and name, NULL for none) with a fresh vid; NULL when
 * out of memory. The pointer lasts until the next add or drop. */
kvf__idrec *kvf__ids_add(kvf__ids *t, uint32_t did, const char *name, void *data);
void kvf__ids_drop(kvf__ids *t, uint32_t vid);
/* The daemon's id for vid (vid itself when unknown). */
uint32_t kvf__ids_out(const kvf__ids *t, uint32_t vid);
/* Whether every vid equals its did (then nothing needs translating). */
bool kvf__ids_identity(const kvf__ids *t);
void kvf__ids_free(kvf__ids *t);

/* A copy of the (vid, did) pairs for translating a long descriptor list
 * without holding the client's lock. */
#define KVF__IDSNAP_INLINE 32
typedef struct kvf__idsnap {
  size_t n;
  bool identity;  /* nothing to translate */
  uint32_t *vid, *did;
  uint32_t inl[2 * KVF__IDSNAP_INLINE];
} kvf__idsnap;
/* -ENOMEM, else 0; kvf__idsnap_free releases it. */
int kvf__ids_snap(const kvf__ids *t, kvf__idsnap *s);
uint32_t kvf__idsnap_out(const kvf__idsnap *s, uint32_t vid);
void kvf__idsnap_free(kvf__idsnap *s);

/* ------------------------------------------------------------ wire
 *
 * The requests kvf_submit writes (an ApiRequest of a GrantReq, SendReq or
 * CancelReq, proto/kvferry.proto), encoded by hand: protobuf-c's generic
 * packing walks field descriptors and took most of a batch's time. The
 * bytes are protobuf-c's for the same message, fields in number order,
 * proto3 zero values left out (tests/unit/test_wire.c compares them). */
enum { KVF__WIRE_GRANT = 1, KVF__WIRE_SEND, KVF__WIRE_CANCEL };

typedef struct kvf__wire_req {
  int kind;                    /* KVF__WIRE_* */
  uint64_t seq;
  const char *xfer_id, *node;  /* node: GrantReq.src_node / SendReq.dst_node */
  const uint8_t *descs;        /* DescList.packed, when has_descs */
  size_t descs_len;
  bool has_descs, has_blocks;
  uint32_t layout;             /* BlockList, when has_blocks */
  const uint8_t *ids;
  size_t ids_len;
  uint32_t first_layer, n_layers;
  uint32_t deadline_ms;
  bool more, continues, layer_events, no_reply;
  size_t id_len, node_len, body_len; /* kvf__wire_size's, for kvf__wire_pack */
} kvf__wire_req;

/* The packed size of r's ApiRequest; notes in r what packing needs. */
size_t kvf__wire_size(kvf__wire_req *r);
/* Writes r's ApiRequest, kvf__wire_size(r) bytes, to out (after
 * kvf__wire_size, r unchanged since). */
void kvf__wire_pack(const kvf__wire_req *r, uint8_t *out);

#endif
