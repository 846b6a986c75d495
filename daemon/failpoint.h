/* failpoint.h - faults for tests, compiled only with -DKVF_FAILPOINTS (the
 * $(BUILD)/tests/kvferryd-rogue build; kvferryd itself has none of this).
 * KVF_FAILPOINT in the environment names the active ones, comma separated:
 *   write-outside-grant  the sending daemon moves one write of each remote
 *                        transfer (of its last part) to just past the end of
 *                        the grant's last range in that pool: a rogue peer
 *                        writing outside its grant (rdma: through one of the
 *                        grant's memory windows)
 *   late-write           rdma, memory windows: 1 s after a transfer
 *                        succeeded, its last write goes again through its
 *                        (by then invalidated) window
 *   write-wrong-qp       rdma, memory windows: the last write of each
 *                        transfer goes through its window but on another QP
 *                        than the one the window is bound on
 *   bad-window-index     rdma, memory windows: the sending daemon reads every
 *                        entry of a Grant's window_of as the next window (as
 *                        a faulty receiver would send it); it must find the
 *                        right windows by search and deliver every byte
 *   result-lost          a receiving daemon that completed a remote grant
 *                        does not send its RecvResult and drops its control
 *                        link to the sender instead (both redial): the
 *                        sender must learn the outcome after reconnecting
 *   result-withheld      the same without the drop: the RecvResult is never
 *                        sent (a test then kills or cuts the receiver)
 *   registry-slow-sync   the registry thread waits 1 s before each read of
 *                        the membership from etcd (a slow etcd at start)
 *   send-done-withheld   a sending daemon never sends SendDone: a receiver
 *                        completes only on bytes that vouch for themselves
 *                        (tcp_wire.h: BATCH_SEALED) or on rdma's last write
 *   close-dial-unread    each of our dials is closed as the first frame
 *                        from the peer comes in, with that frame and the
 *                        rest of the read still to go: as when the dial's
 *                        patience ran out (a timer) in the loop iteration
 *                        whose poll then reads the peer's Hello
 *   idle-close-held      an on-demand link closes for idleness although the
 *                        peer left grants pushed here waiting: as when the
 *                        idle close crossed the push on the wire */
#ifndef KVF_FAILPOINT_H
#define KVF_FAILPOINT_H

#include <stdbool.h>

#include "desc.h"

enum {
  KVF__FP_WRITE_OUTSIDE = 1,
  KVF__FP_LATE_WRITE = 2,
  KVF__FP_WRONG_QP = 3,
  KVF__FP_BAD_WINDOW_INDEX = 4,
  KVF__FP_RESULT_LOST = 5,
  KVF__FP_RESULT_WITHHELD = 6,
  KVF__FP_REGISTRY_SLOW_SYNC = 7,
  KVF__FP_SEND_DONE_WITHHELD = 8,
  KVF__FP_CLOSE_DIAL_UNREAD = 9,
  KVF__FP_IDLE_CLOSE_HELD = 10,
};

bool kvf__failpoint(int which);
/* write-outside-grant: moves the run of runs that ends highest to start at
 * the end of grant's last range in its pool (logged). */
void kvf__failpoint_runs(const kvf__descs *grant, kvf__runs *runs);

#endif
