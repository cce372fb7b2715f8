/* Transfers to and from peers, progressed together through the transport table
 * (progress.c): the one loop every exchange of the core runs in. */
#ifndef RINGSYNC_PROGRESS_H
#define RINGSYNC_PROGRESS_H

#include <stddef.h>

#include "comm.h"

/* A transfer to or from one peer, progressed together with others by rs_progress. */
typedef struct rs_xfer rs_xfer_t;
struct rs_xfer {
    int peer;
    int is_send;
    char *buf;
    size_t len;
    size_t done;
    const size_t *avail;  /* send only: bytes below *avail may go (chain forwarding) */
    void (*on_recv)(rs_xfer_t *x); /* recv only: called after bytes arrive */
    void *arg;
};

/* Progress all transfers until every one is done, a peer fails, or no byte has moved
 * for the communicator's timeout. */
rs_status_t rs_progress(rs_comm_t *comm, rs_xfer_t *xfers, int n);
/* The same, but return as soon as one transfer of at least a byte is done, so that the
 * caller can put the next one in its place (streams of ring steps, ring.c). A caller
 * retires a transfer it has nothing to follow with by setting its length to 0. */
rs_status_t rs_progress_any(rs_comm_t *comm, rs_xfer_t *xfers, int n);
/* Fail with a message that tells a lost peer from one that aborted. */
rs_status_t rs_fail_lost_peer(rs_comm_t *comm, int peer);

static inline rs_xfer_t rs_send_to(int peer, const void *buf, size_t len) {
    rs_xfer_t x = {.peer = peer, .is_send = 1, .buf = (char *)buf, .len = len};
    return x;
}

static inline rs_xfer_t rs_recv_from(int peer, void *buf, size_t len) {
    rs_xfer_t x = {.peer = peer, .is_send = 0, .buf = (char *)buf, .len = len};
    return x;
}

#endif
