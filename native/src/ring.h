/* Rings over a group of the communicator's ranks (ring.c): the building blocks of the
 * flat ring allreduce and of the hierarchical one. */
#ifndef RINGSYNC_RING_H
#define RINGSYNC_RING_H

#include <stddef.h>

#include "comm.h"
#include "progress.h"
#include "reduce.h"

/* A ring over some of the communicator's ranks: position i is rank ranks[i] (ranks NULL:
 * rank i, the flat ring over every rank); `me` is this rank's position. */
typedef struct {
    const int *ranks;
    int n;
    int me;
} rs_group_t;

static inline rs_group_t rs_group_all(const rs_comm_t *comm) {
    return (rs_group_t){NULL, comm->size, comm->rank};
}

/* A buffer cut into blocks, one per ring position: sizes and offsets in bytes (one
 * allocation: free(bytes)). */
typedef struct {
    size_t *bytes;
    size_t *offset;
} rs_blocks_t;

/* `count` elements of `unit` bytes (count * unit must not overflow: the caller checks)
 * in `parts` nearly equal blocks (rs_even_part). */
rs_status_t rs_blocks_even(rs_comm_t *comm, size_t count, int parts, size_t unit,
                           rs_blocks_t *b);
/* One ring pass over a group, taken a step at a time (rs_ring_step): steps 0..n-2
 * reduce-scatter buf's blocks (into `incoming`, a buffer of the largest block, reduced
 * with fn as bytes arrive), steps n-1..2n-3 allgather them. */
typedef struct {
    const rs_group_t *g;
    const rs_blocks_t *blocks;
    char *buf;
    size_t elem;
    rs_reduce_fn fn;
    char *incoming;
} rs_ring_run_t;
/* Where a reduce-scatter step reduces what arrives (x->arg of its receive). */
typedef struct {
    rs_reduce_fn fn;
    char *dst;
    size_t elem;
    size_t reduced; /* bytes of the block already reduced */
} rs_ring_arrival_t;
/* The two transfers of step s (send to the next member, receive from the previous); a
 * reduce-scatter step's receive reduces through *arrival, which must outlive them. */
void rs_ring_step(const rs_ring_run_t *run, int s, rs_xfer_t x[2], rs_ring_arrival_t *arrival);
size_t rs_largest_block(const rs_blocks_t *b, int n);

/* Steps first..last-1 of a run taken as two streams: this member's sends and its
 * receives each go on to their next step as soon as their own transfer is done, not both
 * at the end of every step, so that neither direction of a link waits for the other
 * (pipelining across ring steps). Send step s carries the block that receive step s-1
 * brings, and only as far as that has arrived (and, reduce-scattering, been reduced):
 * its `avail` is the receive's progress until the receive is done. */
typedef struct {
    const rs_ring_run_t *run;
    rs_xfer_t *x; /* x[0] the send, x[1] the receive: the caller progresses them in place */
    int first, last;
    int send_step, recv_step;
    rs_ring_arrival_t arrival; /* the current receive's */
} rs_ring_stream_t;
/* Put steps `first` of `run` into x[0] and x[1] (both of length 0 when first >= last). */
void rs_ring_stream_start(rs_ring_stream_t *s, const rs_ring_run_t *run, rs_xfer_t x[2],
                          int first, int last);
/* After progress (rs_progress_any): each side whose transfer is done takes its next
 * step, or, with none left, gets length 0. Returns whether both sides are through. */
int rs_ring_stream_advance(rs_ring_stream_t *s);
/* In place: afterwards block g->me holds the reduction of that block over the group. */
rs_status_t rs_ring_reduce_scatter(rs_comm_t *comm, const rs_group_t *g, char *buf,
                                   const rs_blocks_t *b, size_t elem, rs_reduce_fn fn);
/* In place: block g->me is this rank's; afterwards it holds every member's block. */
rs_status_t rs_ring_allgather(rs_comm_t *comm, const rs_group_t *g, char *buf,
                              const rs_blocks_t *b);
/* Reduce-scatter, then allgather: the group's reduction of buf, the same bits on every
 * member. */
rs_status_t rs_ring_allreduce(rs_comm_t *comm, const rs_group_t *g, char *buf, size_t count,
                              size_t elem, rs_reduce_fn fn);

#endif
