/* inspect.h - status, pools, peers and transfers rendered for kvferryctl:
 * a human table or one JSON document. */
#ifndef KVF_INSPECT_H
#define KVF_INSPECT_H

/* what: Kvf__InspectWhat. Returns malloc'ed text or NULL. */
char *kvf__inspect_render(int what, int json);

#endif
