/* The transport table: how the layers above move bytes to and from peers without naming
 * a transport (comm.c picks one: transport_tcp.h, transport_shm.h). Types and constants
 * only, so any file may include it. */
#ifndef RINGSYNC_TRANSPORT_H
#define RINGSYNC_TRANSPORT_H

#include <stddef.h>

#include "checked.h" /* RS_MAX_NAME_LEN, for the lane's areas */
#include "comm.h"

/* One wait request handed to a transport's poll: which peer, which direction. */
typedef struct {
    int peer; /* or RS_WAKE_PEER: the communicator's wake_fd */
    int want_read;
    int want_write;
    int ready; /* set by poll */
} rs_wait_t;

#define RS_WAKE_PEER (-1)

/* A transport moves bytes between this rank and its peers. Algorithms only see this
 * table, so a new transport touches no algorithm. send/recv never block: they move
 * what the kernel accepts now and add it to *done. poll blocks until one of the
 * waits can progress, the timeout passes (RS_OK with nothing ready is fine), or a
 * peer breaks (an error naming it). It reports in *lost_peer a peer that hung up
 * while not taking part in the waits (or -1): the caller decides whether to fail. */
typedef struct rs_transport {
    const char *name;
    rs_status_t (*listen)(rs_comm_t *comm, const char *bind_host, int *port);
    /* Connect to the peers flagged in eager[] (the ones the algorithms need), each
     * connection proving knowledge of comm->secret; the others connect on first use. */
    rs_status_t (*connect)(rs_comm_t *comm, const char **hosts, const int *ports,
                           const unsigned char *eager);
    /* *linked: whether a connection to peer exists; if not, one is started (send, recv
     * and poll on such a peer move nothing until it exists). */
    rs_status_t (*reach)(rs_comm_t *comm, int peer, int *linked);
    rs_status_t (*send)(rs_comm_t *comm, int peer, const char *buf, size_t len, size_t *done);
    rs_status_t (*recv)(rs_comm_t *comm, int peer, char *buf, size_t len, size_t *done);
    rs_status_t (*poll)(rs_comm_t *comm, rs_wait_t *waits, int n, int timeout_ms,
                        int *lost_peer);
    void (*abort)(rs_comm_t *comm);
    void (*close)(rs_comm_t *comm);
    /* Whether the peer announced that it gave up (alive, but aborted after a failure). */
    int (*peer_aborted)(rs_comm_t *comm, int peer);
    /* The rank an aborted peer said was lost, from its abort notice (-1: none, or the
     * notice did not say). Reads the peer's stream: only the thread that owns the
     * connections calls it, once the communicator fails anyway. */
    int (*reported_lost)(rs_comm_t *comm, int peer);
    /* From any thread, reading nothing from the stream: RS_PEER_UP, _LOST or _ABORTED
     * (a peer not connected to is UP unless the transport can tell otherwise). */
    int (*peer_state)(rs_comm_t *comm, int peer);
    /* Area `area` (< RS_LANE_AREAS) of `rank`'s shared segment, or NULL unless every
     * peer shares this host's memory with us (the same-host lane needs all of them). */
    void *(*shared_area)(rs_comm_t *comm, int rank, int area);
} rs_transport_t;

/* What a transport's peer_state says about a peer. */
enum { RS_PEER_UP = 0, RS_PEER_LOST = 1, RS_PEER_ABORTED = 2 };

/* The same-host fast lane (lane.c) keeps RS_LANE_AREAS areas of this many bytes in
 * every rank's shared segment; a transport's shared_area finds one. */
#define RS_LANE_MAX_BYTES ((size_t)256 << 10) /* a one-round post, a staged chunk */
#define RS_LANE_AREA_BYTES (2 * (RS_LANE_MAX_BYTES + RS_MAX_NAME_LEN + 1024) + 128)
#define RS_LANE_AREAS 2 /* the lane's (calling threads), the engine thread's */

/* A debug counter: the transports' sends report the bytes they moved to `peer` (a
 * negative count takes back bytes that were no data). Relaxed atomics: a total, read by
 * tests after the collectives they look at have completed. */
enum { RS_VIA_TCP = 0, RS_VIA_SHM = 1 };

static inline void rs_count_sent(rs_comm_t *comm, int via, int peer, int64_t bytes) {
    if (comm->count_traffic && bytes)
        __atomic_fetch_add(&comm->traffic[(size_t)via * comm->size + peer], bytes,
                           __ATOMIC_RELAXED);
}

#endif
