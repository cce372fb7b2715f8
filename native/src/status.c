/* Errors and status: the error record (status.h) and, for a communicator, its error
 * record, the broken flag, the clock, peer host names and scratch memory. At the bottom of
 * the core with util.c: it calls no transport and no algorithm. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm.h"
#include "util.h"

#define RS_VERSION "0.1.0" /* the core's, as rs_version reports it */

const char *rs_version(void) { return RS_VERSION; }

double rs_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- the error record ---- */

rs_status_t rs_error_vset(rs_error_t *err, rs_status_t code, const char *fmt, va_list ap) {
    err->code = code;
    vsnprintf(err->text, sizeof err->text, fmt, ap);
    return code;
}

rs_status_t rs_error_set(rs_error_t *err, rs_status_t code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    rs_error_vset(err, code, fmt, ap);
    va_end(ap);
    return code;
}

rs_status_t rs_error_copy(rs_error_t *to, const rs_error_t *from) {
    if (to != from)
        memcpy(to, from, sizeof *to);
    return to->code;
}

void rs_error_clear(rs_error_t *err) {
    err->code = RS_OK;
    err->text[0] = '\0';
}

/* ---- the communicator's record ---- */

rs_status_t rs_fail(rs_comm_t *comm, rs_status_t status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&comm->error_mu);
    rs_error_vset(&comm->error, status, fmt, ap);
    pthread_mutex_unlock(&comm->error_mu);
    va_end(ap);
    if (status == RS_ERR_COMM || status == RS_ERR_TIMEOUT)
        __atomic_store_n(&comm->broken, 1, __ATOMIC_RELEASE); /* read by other threads */
    return status;
}

rs_status_t rs_comm_error(rs_comm_t *comm, rs_error_t *out) {
    pthread_mutex_lock(&comm->error_mu);
    rs_error_copy(out, &comm->error);
    pthread_mutex_unlock(&comm->error_mu);
    return out->code;
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

const char *rs_comm_last_error(const rs_comm_t *comm) { return comm->error.text; }
int rs_comm_rank(const rs_comm_t *comm) { return comm->rank; }
int rs_comm_size(const rs_comm_t *comm) { return comm->size; }
int rs_comm_is_broken(const rs_comm_t *comm) {
    return __atomic_load_n(&comm->broken, __ATOMIC_ACQUIRE);
}

/* ---- the words for how a wait ends, written once ---- */

void rs_peer_gone_text(const rs_comm_t *comm, int peer, int aborted, int reported, char *out,
                       size_t cap) {
    if (aborted && reported >= 0 && reported < comm->size && reported != comm->rank)
        snprintf(out, cap, "rank %d: connection to rank %d (host %s) was lost, as rank %d "
                 "(host %s) reported before it aborted (peer process gone, or its host or "
                 "the network down?)", comm->rank, reported, rs_peer_host(comm, reported),
                 peer, rs_peer_host(comm, peer));
    else if (aborted)
        snprintf(out, cap, "rank %d: rank %d (host %s) aborted after a failure elsewhere in "
                 "the job", comm->rank, peer, rs_peer_host(comm, peer));
    else
        snprintf(out, cap, "rank %d: connection to rank %d (host %s) was lost (peer process "
                 "gone, or its host or the network down?)", comm->rank, peer,
                 rs_peer_host(comm, peer));
}

void rs_note_lost(rs_comm_t *comm, int peer) {
    int none = -1;
    __atomic_compare_exchange_n(&comm->lost_rank, &none, peer, 0, __ATOMIC_ACQ_REL,
                                __ATOMIC_ACQUIRE);
}

void rs_report_stall(const char *name, int kind, const char *have, const char *missing,
                     double waited) {
    fprintf(stderr, "ringsync: stall: tensor '%s' (%s) was submitted by ranks %s but ranks %s "
            "have not submitted it after %.1f s\n", name, rs_kind_name(kind), have, missing,
            waited);
    fflush(stderr);
}

void rs_submit_timeout_text(const rs_comm_t *comm, const char *name, int kind, double waited,
                            const char *missing, char *out, size_t cap) {
    snprintf(out, cap, "rank %d: tensor '%s' (%s) waited %.1f s for ranks %s to submit it "
             "(RINGSYNC_TIMEOUT_SECONDS=%g); giving up", comm->rank, name, rs_kind_name(kind),
             waited, missing, comm->timeout_seconds);
}
