/* peer_int.h - what peer.c lends peer_members.c (reload and registry
 * membership): slots, teardown, dialing. Loop thread only. */
#ifndef KVF_PEER_INT_H
#define KVF_PEER_INT_H

#include "peer.h"

/* The slot of name, removed ones included; else a fresh one, or NULL. */
kvf__peer *kvf__peer_slot_for(const char *name);
/* Ends every connection of p (its transfers fail) and stops redialing. */
void kvf__peer_drop(kvf__peer *p, const char *why);
/* p's link is lost (its transfers fail); redials (or goes idle). */
void kvf__peer_take_down(kvf__peer *p, const char *why);
/* Registry members, and static peers with peer-connect on-demand. */
bool kvf__peer_on_demand(const kvf__peer *p);
/* Dials p, or leaves it idle until a need when it is on demand. */
void kvf__peer_start_link(kvf__peer *p);
/* Every slot, removed peers included. */
size_t kvf__peer_slots(void);
kvf__peer *kvf__peer_slot(size_t i);
int kvf__peer_resolve(const char *host, uint16_t port, struct sockaddr_storage *ss, socklen_t *len);
/* After a reload: heartbeat-ms applies. */
void kvf__peers_heartbeat_restart(void);

#endif
