/* api.h - the local API: client sessions on a Unix socket. */
#ifndef KVF_API_H
#define KVF_API_H

#include "kvferryd.h"

int kvf__api_start(uv_loop_t *loop, char *err, size_t errlen);
/* Stops accepting; existing sessions are closed. */
void kvf__api_stop(void);
/* Closes the listening socket (and removes its path); sessions stay. */
void kvf__api_stop_accepting(void);
void kvf__api_emit(kvf__session *s, const Kvf__Event *ev);
void kvf__api_session_xfers(kvf__session *s, int delta);
size_t kvf__api_sessions(void);

#endif
