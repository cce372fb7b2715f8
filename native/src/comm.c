/* Communicator lifecycle, error recording and the transfer progress loop. */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

const char *rs_version(void) { return RS_VERSION; }

double rs_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

rs_status_t rs_fail(rs_comm_t *comm, rs_status_t status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(comm->last_error, sizeof comm->last_error, fmt, ap);
    va_end(ap);
    if (status == RS_ERR_COMM || status == RS_ERR_TIMEOUT)
        comm->broken = 1;
    return status;
}

const char *rs_peer_host(const rs_comm_t *comm, int peer) {
    if (comm->host_names && peer >= 0 && peer < comm->size && comm->host_names[peer])
        return comm->host_names[peer];
    return "?";
}

rs_status_t rs_scratch(rs_comm_t *comm, size_t bytes, void **out) {
    if (bytes > comm->scratch_bytes) {
        void *grown = realloc(comm->scratch, bytes);
        if (!grown)
            return rs_fail(comm, RS_ERR_NOMEM, "cannot allocate %zu bytes of scratch space", bytes);
        comm->scratch = grown;
        comm->scratch_bytes = bytes;
    }
    *out = comm->scratch;
    return RS_OK;
}

rs_status_t rs_comm_create(int rank, int size, const char *bind_host, double timeout_seconds,
                           double setup_seconds, rs_comm_t **out_comm, int *out_port) {
    if (size < 1 || rank < 0 || rank >= size || !out_comm || !out_port ||
        !(timeout_seconds >= 0) || !(setup_seconds > 0))
        return RS_ERR_USAGE;
    rs_comm_t *comm = calloc(1, sizeof *comm);
    if (!comm)
        return RS_ERR_NOMEM;
    comm->rank = rank;
    comm->size = size;
    comm->timeout_seconds = timeout_seconds;
    comm->setup_seconds = setup_seconds;
    comm->transport = &rs_tcp_transport;
    comm->wake_fd = -1;
    comm->host_names = calloc((size_t)size, sizeof *comm->host_names);
    if (!comm->host_names) {
        free(comm);
        return RS_ERR_NOMEM;
    }
    *out_comm = comm;
    return comm->transport->listen(comm, bind_host ? bind_host : "", out_port);
}

rs_status_t rs_comm_connect(rs_comm_t *comm, const char **hosts, const int *ports,
                            const char **host_names, uint64_t job_id,
                            const unsigned char *secret, size_t secret_len) {
    if (!secret || secret_len < 16 || secret_len > RS_SECRET_MAX)
        return rs_fail(comm, RS_ERR_USAGE, "the job secret must have 16 to %d bytes, not %zu",
                       RS_SECRET_MAX, secret_len);
    comm->job_id = job_id;
    memcpy(comm->secret, secret, secret_len);
    comm->secret_len = secret_len;
    for (int i = 0; i < comm->size; i++) {
        free(comm->host_names[i]);
        comm->host_names[i] = strdup(host_names && host_names[i] ? host_names[i] : hosts[i]);
        if (!comm->host_names[i])
            return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    }
    RS_CHECK(comm->transport->connect(comm, hosts, ports));
    if (comm->transport_mode == RS_TRANSPORT_TCP || comm->size == 1)
        return RS_OK;
    /* Shared-memory setup exchanges over the new connections: it is still setup, bounded
     * by the setup deadline even where the collectives have no limit (a peer that hangs in
     * init() must not hang the others forever). Single-threaded here: no engine yet. */
    double limit = comm->timeout_seconds;
    comm->timeout_seconds = comm->setup_seconds;
    rs_status_t st = rs_shm_setup(comm, comm->transport_mode == RS_TRANSPORT_SHM);
    comm->timeout_seconds = limit;
    return st;
}

rs_status_t rs_comm_set_transport(rs_comm_t *comm, int mode) {
    if (mode != RS_TRANSPORT_AUTO && mode != RS_TRANSPORT_TCP && mode != RS_TRANSPORT_SHM)
        return rs_fail(comm, RS_ERR_USAGE, "unknown transport mode %d", mode);
    comm->transport_mode = mode;
    return RS_OK;
}

rs_status_t rs_comm_set_spin(rs_comm_t *comm, double seconds) {
    if (!(seconds >= 0 && seconds <= 1))
        return rs_fail(comm, RS_ERR_USAGE, "spin time %g s is not between 0 and 1 s", seconds);
    comm->spin_seconds = seconds;
    return RS_OK;
}

rs_status_t rs_comm_set_small_allreduce(rs_comm_t *comm, size_t bytes) {
    comm->small_allreduce_bytes = bytes;
    return RS_OK;
}

const char *rs_comm_transport_name(const rs_comm_t *comm) { return comm->transport->name; }

rs_status_t rs_comm_abort(rs_comm_t *comm) {
    if (comm->transport_state)
        comm->transport->abort(comm);
    if (!comm->broken)
        rs_fail(comm, RS_ERR_COMM, "communicator aborted on rank %d", comm->rank);
    return RS_OK;
}

void rs_comm_destroy(rs_comm_t *comm) {
    if (!comm)
        return;
    if (comm->broken && comm->transport_state)
        comm->transport->abort(comm); /* tell peers we abort, rather than died */
    comm->transport->close(comm);
    for (int i = 0; i < comm->size; i++)
        free(comm->host_names[i]);
    free(comm->host_names);
    free(comm->scratch);
    free(comm);
}

const char *rs_comm_last_error(const rs_comm_t *comm) { return comm->last_error; }
int rs_comm_rank(const rs_comm_t *comm) { return comm->rank; }
int rs_comm_size(const rs_comm_t *comm) { return comm->size; }
int rs_comm_is_broken(const rs_comm_t *comm) { return comm->broken; }

/* ---- progress loop ---- */

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
    if (comm->transport->peer_aborted(comm, peer))
        return rs_fail(comm, RS_ERR_COMM, "rank %d: rank %d (host %s) aborted after a failure "
                       "elsewhere in the job", comm->rank, peer, rs_peer_host(comm, peer));
    return rs_fail(comm, RS_ERR_COMM, "rank %d: connection to rank %d (host %s) was lost "
                   "(peer process gone?)", comm->rank, peer, rs_peer_host(comm, peer));
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

rs_status_t rs_progress(rs_comm_t *comm, rs_xfer_t *xfers, int n) {
    if (comm->broken)
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
        if (st != RS_OK || pending == 0)
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
