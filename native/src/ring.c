/* Ring building blocks over a group of the communicator's ranks: reduce-scatter,
 * allgather and their sum, the ring allreduce. The flat ring is the group of every rank;
 * the hierarchical allreduce (hierarchical.c) runs them over a host's ranks and over the
 * ranks with the same place on every host. */
#include <stdlib.h>

#include "ring.h"
#include "util.h"

/* Received data is reduced in pieces of this size while the rest is still arriving,
 * so that reduction overlaps transfer within each ring step. */
#define RS_REDUCE_SEGMENT_BYTES (256 * 1024)

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* The communicator rank at ring position `position` (taken modulo the group's size). */
static int member(const rs_group_t *g, int position) {
    int p = mod(position, g->n);
    return g->ranks ? g->ranks[p] : p;
}

rs_status_t rs_blocks_even(rs_comm_t *comm, size_t count, int parts, size_t unit,
                           rs_blocks_t *b) {
    b->bytes = malloc(2 * (size_t)parts * sizeof(size_t));
    if (!b->bytes)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    b->offset = b->bytes + parts;
    for (int i = 0; i < parts; i++) {
        rs_even_part(count, parts, i, &b->offset[i], &b->bytes[i]);
        b->offset[i] *= unit; /* at most count * unit, which the caller checked */
        b->bytes[i] *= unit;
    }
    return RS_OK;
}

static void reduce_arrived(rs_xfer_t *x) {
    rs_ring_arrival_t *r = (rs_ring_arrival_t *)x->arg;
    size_t ready = x->done - x->done % r->elem;
    if (x->done < x->len && ready - r->reduced < RS_REDUCE_SEGMENT_BYTES)
        return;
    r->fn(r->dst + r->reduced, x->buf + r->reduced, (ready - r->reduced) / r->elem);
    r->reduced = ready;
}

/* Reduce-scatter step s (s < n-1): a member sends block me-s-1 and reduces the incoming
 * block me-s-2 into its own copy, which it sends on at step s+1. Each block is reduced in
 * one place, in ring order, so that its owner's bits are the only ones that exist.
 * Allgather step t = s-(n-1): it sends block me-t and receives block me-t-1 in place. */
void rs_ring_step(const rs_ring_run_t *run, int s, rs_xfer_t x[2], rs_ring_arrival_t *a) {
    const rs_group_t *g = run->g;
    const rs_blocks_t *b = run->blocks;
    int to = member(g, g->me + 1), from = member(g, g->me - 1);
    if (s < g->n - 1) {
        int out = mod(g->me - s - 1, g->n), in = mod(g->me - s - 2, g->n);
        *a = (rs_ring_arrival_t){run->fn, run->buf + b->offset[in], run->elem, 0};
        x[0] = rs_send_to(to, run->buf + b->offset[out], b->bytes[out]);
        x[1] = rs_recv_from(from, run->incoming, b->bytes[in]);
        x[1].on_recv = reduce_arrived;
        x[1].arg = a;
        return;
    }
    int t = s - (g->n - 1);
    int out = mod(g->me - t, g->n), in = mod(g->me - t - 1, g->n);
    x[0] = rs_send_to(to, run->buf + b->offset[out], b->bytes[out]);
    x[1] = rs_recv_from(from, run->buf + b->offset[in], b->bytes[in]);
}

size_t rs_largest_block(const rs_blocks_t *b, int n) {
    size_t largest = 0;
    for (int i = 0; i < n; i++)
        largest = b->bytes[i] > largest ? b->bytes[i] : largest;
    return largest;
}

static int xfer_done(const rs_xfer_t *x) { return x->done >= x->len; }

static void retire(rs_xfer_t *x) { *x = (rs_xfer_t){.peer = -1}; }

/* An allgather step's receive only counts what has arrived: the gate of the next send. */
static void note_arrived(rs_xfer_t *x) { ((rs_ring_arrival_t *)x->arg)->reduced = x->done; }

static void start_receive(rs_ring_stream_t *s) {
    rs_xfer_t pair[2];
    rs_ring_step(s->run, s->recv_step, pair, &s->arrival);
    if (!pair[1].on_recv) {
        s->arrival = (rs_ring_arrival_t){0};
        pair[1].on_recv = note_arrived;
        pair[1].arg = &s->arrival;
    }
    s->x[1] = pair[1];
}

static void start_send(rs_ring_stream_t *s) {
    rs_xfer_t pair[2];
    rs_ring_arrival_t unused;
    rs_ring_step(s->run, s->send_step, pair, &unused);
    s->x[0] = pair[0];
    if (s->send_step > s->first && s->recv_step == s->send_step - 1)
        s->x[0].avail = &s->arrival.reduced; /* its block is still arriving */
}

void rs_ring_stream_start(rs_ring_stream_t *s, const rs_ring_run_t *run, rs_xfer_t x[2],
                          int first, int last) {
    *s = (rs_ring_stream_t){.run = run, .x = x, .first = first, .last = last,
                            .send_step = first, .recv_step = first};
    if (first >= last) {
        retire(&x[0]);
        retire(&x[1]);
        return;
    }
    start_receive(s);
    start_send(s);
}

int rs_ring_stream_advance(rs_ring_stream_t *s) {
    if (s->first >= s->last)
        return 1;
    for (int moved = 1; moved;) {
        moved = 0;
        if (xfer_done(&s->x[1]) && s->recv_step + 1 < s->last) {
            s->x[0].avail = NULL; /* a send waiting for this receive's block has it all */
            s->recv_step++;
            start_receive(s);
            moved = 1;
        }
        if (xfer_done(&s->x[0]) && s->send_step + 1 < s->last) {
            s->send_step++;
            start_send(s);
            moved = 1;
        }
    }
    int through = 1;
    for (int i = 0; i < 2; i++) {
        if (xfer_done(&s->x[i]))
            retire(&s->x[i]); /* its last step: nothing follows it */
        else
            through = 0;
    }
    return through;
}

/* Steps first..last-1 of a run, as two streams. */
static rs_status_t run_steps(rs_comm_t *comm, const rs_ring_run_t *run, int first, int last) {
    rs_xfer_t x[2];
    rs_ring_stream_t s;
    rs_ring_stream_start(&s, run, x, first, last);
    while (!rs_ring_stream_advance(&s))
        RS_CHECK(rs_progress_any(comm, x, 2));
    return RS_OK;
}

rs_status_t rs_ring_reduce_scatter(rs_comm_t *comm, const rs_group_t *g, char *buf,
                                   const rs_blocks_t *b, size_t elem, rs_reduce_fn fn) {
    rs_ring_run_t run = {g, b, buf, elem, fn, NULL};
    RS_CHECK(rs_scratch(comm, rs_largest_block(b, g->n), (void **)&run.incoming));
    return run_steps(comm, &run, 0, g->n - 1);
}

rs_status_t rs_ring_allgather(rs_comm_t *comm, const rs_group_t *g, char *buf,
                              const rs_blocks_t *b) {
    rs_ring_run_t run = {g, b, buf, 0, NULL, NULL};
    return run_steps(comm, &run, g->n - 1, 2 * (g->n - 1));
}

rs_status_t rs_ring_allreduce(rs_comm_t *comm, const rs_group_t *g, char *buf, size_t count,
                              size_t elem, rs_reduce_fn fn) {
    rs_blocks_t b;
    RS_CHECK(rs_blocks_even(comm, count, g->n, elem, &b));
    rs_status_t st;
    RS_CHECK_GOTO(rs_ring_reduce_scatter(comm, g, buf, &b, elem, fn), st, out);
    st = rs_ring_allgather(comm, g, buf, &b);
out:
    free(b.bytes);
    return st;
}
