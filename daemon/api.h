/* api.h - the local API: client sessions on a Unix socket. */
#ifndef KVF_API_H
#define KVF_API_H

#include "kvferryd.h"

/* Refuses a socket path another kvferryd listens on (and clears a stale
 * socket left there); what kvf__api_start does first, for a check before
 * the pools are made. */
int kvf__api_check_socket(char *err, size_t errlen);
int kvf__api_start(uv_loop_t *loop, char *err, size_t errlen);
/* Stops accepting; existing sessions are closed. */
void kvf__api_stop(void);
/* Closes the listening socket (and removes its path); sessions stay. */
void kvf__api_stop_accepting(void);
void kvf__api_emit(kvf__session *s, const Kvf__Event *ev);
/* Tells s that xfer_id's event is expected within about within_us (an API
 * Soon: a hint its library may poll for the event on). */
void kvf__api_soon(kvf__session *s, const char *xfer_id, uint32_t within_us);
/* Whether s takes a Soon (its Hello did not say no_soon): where it does
 * not, a transport skips the work of finding one. */
bool kvf__api_wants_soon(const kvf__session *s);
/* The same where a transport estimated the time to the event (est_us):
 * told only within KVF__SOON_MAX_US (beyond it, two of the engine's threads
 * would poll longer than their wake-up costs); whether it was. */
#define KVF__SOON_MAX_US 2000
bool kvf__api_soon_estimated(kvf__session *s, const char *xfer_id, double est_us);
void kvf__api_session_xfers(kvf__session *s, int delta);
size_t kvf__api_sessions(void);
/* Bytes of replies and events written to clients and not yet taken by
 * their sockets, all clients together (api-output-budget bounds it). */
size_t kvf__api_output_bytes(void);
/* Who a session is, for listings: its client id and process. */
uint32_t kvf__api_session_id(const kvf__session *s);
pid_t kvf__api_session_pid(const kvf__session *s);

/* A session with no socket (tests, tests/fuzz): bytes given to
 * kvf__api_feed take the path a client's reads take (frame buffer, max-frame,
 * ApiRequest unpack, the requests, the transfers), and every frame the daemon
 * would write to the client (u32 length + ApiMessage) goes to sink, with the
 * pool fd a MapResp carries (-1 for none; not to be closed). Credentials
 * and max-clients are checked as for a connection. */
typedef void kvf__api_sink(kvf__session *s, const uint8_t *frame, size_t len, int fd, void *arg);
kvf__session *kvf__api_session_detached(pid_t pid, uid_t uid, gid_t gid, kvf__api_sink *sink,
                                        void *arg);
/* 0, or KVF_EDAEMON once the session is closed (a bad frame, a refused
 * client, no hello): it reads nothing more. */
int kvf__api_feed(kvf__session *s, const void *data, size_t n);
bool kvf__api_session_closed(const kvf__session *s);
/* Closes a detached session (its transfers fail) and frees it. */
void kvf__api_session_free(kvf__session *s);

#endif
