/* Status and errors of a communicator: the last-error text, the broken flag, the clock,
 * peer host names and scratch memory. At the bottom of the core with util.c: it calls no
 * transport and no algorithm. */
#define _GNU_SOURCE
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
        __atomic_store_n(&comm->broken, 1, __ATOMIC_RELEASE); /* read by other threads */
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

const char *rs_comm_last_error(const rs_comm_t *comm) { return comm->last_error; }
int rs_comm_rank(const rs_comm_t *comm) { return comm->rank; }
int rs_comm_size(const rs_comm_t *comm) { return comm->size; }
int rs_comm_is_broken(const rs_comm_t *comm) {
    return __atomic_load_n(&comm->broken, __ATOMIC_ACQUIRE);
}
