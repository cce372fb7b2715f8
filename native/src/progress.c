/* The transfer progress loop: moves a set of transfers to and from peers through the
 * communicator's transport table until all are done, a peer fails, or (with a timeout)
 * nothing moves for too long. */
#include <math.h>
#include <stdlib.h>

#include "progress.h"
#include "transport.h"

static size_t send_limit(const rs_xfer_t *x) {
    if (x->avail && *x->avail < x->len)
        return *x->avail;
    return x->len;
}

/* Try every unfinished transfer once without blocking. */
static rs_status_t progress_once(rs_comm_t *comm, rs_xfer_t *xfers, int n, int *moved,
                                 int *pending) {
    *moved = 0;
    *pending = 0;
    for (int i = 0; i < n; i++) {
        rs_xfer_t *x = &xfers[i];
        if (x->done >= x->len)
            continue;
        size_t before = x->done;
        if (x->is_send) {
            size_t limit = send_limit(x);
            if (x->done < limit)
                RS_CHECK(comm->transport->send(comm, x->peer, x->buf, limit, &x->done));
        } else {
            RS_CHECK(comm->transport->recv(comm, x->peer, x->buf, x->len, &x->done));
            if (x->done > before && x->on_recv)
                x->on_recv(x);
        }
        if (x->done > before)
            *moved = 1;
        if (x->done < x->len)
            (*pending)++;
    }
    return RS_OK;
}

static int build_waits(const rs_xfer_t *xfers, int n, rs_wait_t *waits) {
    int k = 0;
    for (int i = 0; i < n; i++) {
        const rs_xfer_t *x = &xfers[i];
        if (x->done >= x->len)
            continue;
        if (x->is_send && x->done >= send_limit(x))
            continue; /* waiting on our own receive, not on the socket */
        waits[k].peer = x->peer;
        waits[k].want_read = !x->is_send;
        waits[k].want_write = x->is_send;
        k++;
    }
    return k;
}

rs_status_t rs_fail_lost_peer(rs_comm_t *comm, int peer) {
    char text[RS_ERROR_LEN];
    int aborted = comm->transport->peer_aborted(comm, peer);
    int reported = aborted ? comm->transport->reported_lost(comm, peer) : -1;
    if (!aborted || reported >= 0)
        rs_note_lost(comm, aborted ? reported : peer);
    rs_peer_gone_text(comm, peer, aborted, reported, text, sizeof text);
    return rs_fail(comm, RS_ERR_COMM, "%s", text);
}

static rs_status_t fail_no_progress(rs_comm_t *comm, const rs_xfer_t *xfers, int n,
                                    int lost_peer, double waited) {
    int peer = lost_peer;
    for (int i = 0; i < n && peer < 0; i++)
        if (xfers[i].done < xfers[i].len)
            peer = xfers[i].peer;
    if (lost_peer >= 0)
        return rs_fail_lost_peer(comm, lost_peer);
    return rs_fail(comm, RS_ERR_TIMEOUT,
                   "rank %d: timed out after %.1f s waiting for rank %d (host %s) "
                   "(RINGSYNC_TIMEOUT_SECONDS=%g)",
                   comm->rank, waited, peer, rs_peer_host(comm, peer), comm->timeout_seconds);
}

/* A peer outside this exchange hanging up is suspicious but not yet fatal: at the end
 * of a job a rank that finished may close while we still finish our last step. If no
 * byte moves for this long after such a hangup, the peer is declared lost. */
#define RS_HANGUP_GRACE_SECONDS 2.0

static int done(const rs_xfer_t *x) { return x->done >= x->len; }

static int any_done(const rs_xfer_t *xfers, int n) {
    for (int i = 0; i < n; i++)
        if (xfers[i].len > 0 && done(&xfers[i]))
            return 1;
    return 0;
}

/* stop (or NULL: when all are done) says when enough transfers are done. */
static rs_status_t progress_until(rs_comm_t *comm, rs_xfer_t *xfers, int n,
                                  int (*stop)(const rs_xfer_t *, int));

rs_status_t rs_progress(rs_comm_t *comm, rs_xfer_t *xfers, int n) {
    return progress_until(comm, xfers, n, NULL);
}

rs_status_t rs_progress_any(rs_comm_t *comm, rs_xfer_t *xfers, int n) {
    return any_done(xfers, n) ? RS_OK : progress_until(comm, xfers, n, any_done);
}

static rs_status_t progress_until(rs_comm_t *comm, rs_xfer_t *xfers, int n,
                                  int (*stop)(const rs_xfer_t *, int)) {
    if (__atomic_load_n(&comm->broken, __ATOMIC_ACQUIRE))
        return rs_fail(comm, RS_ERR_COMM, "rank %d: communicator is broken by an earlier "
                       "failure; it must be rebuilt", comm->rank);
    rs_wait_t stack_waits[16];
    rs_wait_t *waits = n <= 16 ? stack_waits : malloc((size_t)n * sizeof *waits);
    if (!waits)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rs_status_t st = RS_OK;
    double last_move = rs_now();
    double hangup_at = 0;
    int lost_peer = -1;
    for (;;) {
        int moved, pending;
        st = progress_once(comm, xfers, n, &moved, &pending);
        if (st != RS_OK || pending == 0 || (stop && stop(xfers, n)))
            break;
        double now = rs_now();
        if (moved)
            last_move = now;
        double deadline = comm->timeout_seconds > 0 ? last_move + comm->timeout_seconds : HUGE_VAL;
        if (lost_peer >= 0 && hangup_at + RS_HANGUP_GRACE_SECONDS < deadline)
            deadline = (last_move > hangup_at ? last_move : hangup_at) + RS_HANGUP_GRACE_SECONDS;
        if (now >= deadline) {
            st = fail_no_progress(comm, xfers, n, lost_peer, now - last_move);
            break;
        }
        if (moved)
            continue;
        int k = build_waits(xfers, n, waits);
        /* Without a deadline, wake once a second anyway (a cheap look at the peers). */
        int timeout_ms = deadline - now > 1.0 ? 1000 : (int)((deadline - now) * 1000.0) + 1;
        int newly_lost = -1;
        st = comm->transport->poll(comm, waits, k, timeout_ms, &newly_lost);
        if (st != RS_OK)
            break;
        if (newly_lost >= 0 && lost_peer < 0) {
            lost_peer = newly_lost;
            hangup_at = rs_now();
        }
    }
    if (waits != stack_waits)
        free(waits);
    return st;
}
