/* peer_members.c - which peers this daemon has: the peer lines (SIGHUP
 * makes the peers match them) and the registry's members (registry.c).
 * The connections themselves are peer.c's (peer_int.h). */
#include "peer.h"

#include <stdio.h>
#include <string.h>

#include "peer_int.h"
#include "xfer.h"

static bool in_config(const char *name) {
  for (size_t i = 0; i < kvfd.cfg.n_peers; i++)
    if (strcmp(kvfd.cfg.peers[i].name, name) == 0) return true;
  return false;
}

/* Brings one peer in line: new, revived or readdressed; from a peer line
 * (registered false) or the registry. */
static void configure(const kvf__peer_cfg *pc, bool registered, const char *from) {
  kvf__peer *p = kvf__peer_slot_for(pc->name);
  if (!p) {
    kvf__err("%s: no room for peer %s (%d peers over this daemon's life); restart kvferryd",
             from, pc->name, KVF__MAX_PEERS_CFG);
    return;
  }
  bool same_addr = !strcmp(p->cfg.host, pc->host) && p->cfg.port == pc->port;
  if (!p->removed && !strcmp(p->cfg.name, pc->name) && same_addr) {
    p->registered = registered; /* unchanged, but a peer line now owns it (or no more) */
    return;
  }
  struct sockaddr_storage addr;
  socklen_t len;
  if (kvf__peer_resolve(pc->host, pc->port, &addr, &len) != 0) {
    kvf__err("%s: peer %s: cannot resolve %s; left as it was", from, pc->name, pc->host);
    return;
  }
  bool added = p->removed;
  if (!added) kvf__peer_drop(p, "its address changed");
  if (strcmp(p->cfg.name, pc->name) != 0) { /* a recycled slot starts afresh */
    p->ups = p->downs = 0;
    p->last_error[0] = '\0';
  }
  p->cfg = *pc;
  p->addr = addr;
  p->addrlen = len;
  p->backoff_ms = 0;
  p->removed = false;
  p->registered = registered;
  kvf__info("%s: peer %s %s (%s:%u)", from, pc->name, added ? "added" : "readdressed", pc->host,
            pc->port);
  kvf__peer_start_link(p);
}

static void reload_one(const kvf__peer_cfg *pc) { configure(pc, false, "reload"); }

void kvf__peers_member_put(const kvf__peer_cfg *pc, uint64_t incarnation) {
  kvf__peer *p = kvf__peer_find(pc->name);
  if (p && !p->registered) return; /* a peer line names it: the line wins */
  configure(pc, true, "registry");
  p = kvf__peer_find(pc->name);
  if (!p) return;
  bool restarted = p->reg_incarnation && incarnation != p->reg_incarnation;
  p->reg_incarnation = incarnation;
  /* The old incarnation is gone for good: what is bound to it fails now,
   * not when its connection times out. */
  if (restarted && p->state == KVF__PEER_UP && p->remote_session != incarnation)
    kvf__peer_take_down(p, "the peer restarted (a new incarnation in the registry)");
  else if (restarted && p->state != KVF__PEER_UP)
    kvf__xfer_on_peer_restarted(p, incarnation);
}

void kvf__peers_member_gone(const char *name, const char *why) {
  kvf__peer *p = kvf__peer_find(name);
  if (!p || !p->registered) return;
  kvf__peer_drop(p, why);
  p->removed = true;
  p->reg_incarnation = 0;
  kvf__xfer_on_peer_removed(p); /* what waited for it fails now */
  kvf__info("registry: peer %s removed (%s)", name, why);
}

void kvf__peers_reload(void) {
  for (size_t i = 0; i < kvf__peer_slots(); i++) {
    kvf__peer *p = kvf__peer_slot(i);
    if (p->removed || p->registered || in_config(p->cfg.name)) continue;
    kvf__peer_drop(p, "removed from the configuration");
    p->removed = true;
    kvf__xfer_on_peer_removed(p); /* what waited for it fails now */
    kvf__info("reload: peer %s removed", p->cfg.name);
  }
  for (size_t i = 0; i < kvfd.cfg.n_peers; i++) reload_one(&kvfd.cfg.peers[i]);
  for (size_t i = 0; i < kvf__peer_slots(); i++) { /* peer-connect went eager */
    kvf__peer *p = kvf__peer_slot(i);
    if (p->state == KVF__PEER_IDLE && !kvf__peer_on_demand(p)) kvf__peer_start_link(p);
  }
  kvf__peers_heartbeat_restart();
}
