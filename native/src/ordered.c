/* Reductions in rank order: each rank gathers every rank's copy of the elements it
 * reduces, then folds them rank 0's first. The ring cannot give that order: block b's
 * fold starts at rank b+1, so an element's bits depend on which block it fell in, and
 * with it on the buffer's size, the fusion and the algorithm. Here they depend only on the
 * ranks' values of that element (the kernels work element by element), which is what the
 * deterministic mode promises. */
#include <stdlib.h>
#include <string.h>

#include "ordered.h"
#include "progress.h"

/* Copies are folded as they arrive, in pieces of at least this size (the last may be
 * shorter), so that the fold overlaps the transfers as the ring's reduction does. */
#define FOLD_SEGMENT_BYTES (256 * 1024)

struct fold;

/* One rank's copy of my block: where it is, how much of it is here and how much of it is
 * folded into the result. */
typedef struct {
    char *data;
    size_t arrived;
    size_t folded;
    struct fold *fold; /* (for the receive's callback) */
} part_t;

/* The result gathers in rank 0's part (set_parts): part p is folded into it only as far
 * as parts 1..p-1 are, so that every element sees rank 0's value, then rank 1's, ... */
typedef struct fold {
    rs_reduce_fn fn;
    size_t elem, bytes;
    int size;
    part_t *parts;
} fold_t;

static void fold_ready(fold_t *f) {
    char *result = f->parts[0].data;
    size_t upto = f->parts[0].arrived;
    for (int p = 1; p < f->size; p++) {
        part_t *part = &f->parts[p];
        size_t can = part->arrived < upto ? part->arrived : upto, from = part->folded;
        can -= can % f->elem;
        if (can > from && (can == f->bytes || can - from >= FOLD_SEGMENT_BYTES)) {
            f->fn(result + from, part->data + from, (can - from) / f->elem);
            part->folded = can;
        }
        upto = part->folded;
    }
}

static void part_arrived(rs_xfer_t *x) {
    part_t *part = (part_t *)x->arg;
    part->arrived = x->done;
    fold_ready(part->fold);
}

/* Send block p of buf to every peer p and receive each peer's copy of my block into its
 * part, all at once, folding as the copies arrive. */
static rs_status_t exchange(rs_comm_t *comm, char *buf, const rs_blocks_t *b, fold_t *f) {
    int size = comm->size, me = comm->rank;
    rs_xfer_t stack_xfers[32];
    rs_xfer_t *x = 2 * size <= 32 ? stack_xfers : malloc(2 * (size_t)size * sizeof *x);
    if (!x)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    int n = 0;
    for (int p = 0; p < size; p++) {
        if (p == me)
            continue;
        x[n++] = rs_send_to(p, buf + b->offset[p], b->bytes[p]);
        x[n] = rs_recv_from(p, f->parts[p].data, f->bytes);
        x[n].on_recv = part_arrived;
        x[n++].arg = &f->parts[p];
    }
    rs_status_t st = rs_progress(comm, x, n);
    if (x != stack_xfers)
        free(x);
    return st;
}

/* The parts: a slot per peer in `slots`, my own block of buf for me. The result gathers
 * in rank 0's part: its slot, or for rank 0 its own block, folded in place where no send
 * reads it (`disjoint` blocks), else a copy of it in its slot. */
static void set_parts(fold_t *f, int me, char *slots, char *mine, int disjoint) {
    for (int p = 0; p < f->size; p++) {
        part_t *part = &f->parts[p];
        *part = (part_t){slots + (size_t)p * f->bytes, 0, 0, f};
        if (p == me && (p != 0 || disjoint))
            part->data = mine;
        if (p == me)
            part->arrived = f->bytes;
    }
    if (me == 0 && !disjoint)
        memcpy(slots, mine, f->bytes);
}

static rs_status_t reduce_scatter(rs_comm_t *comm, char *buf, const rs_blocks_t *b,
                                  size_t elem, rs_reduce_fn fn, int disjoint) {
    int size = comm->size, me = comm->rank;
    fold_t f = {fn, elem, b->bytes[me], size, malloc((size_t)size * sizeof(part_t))};
    char *slots, *mine = buf + b->offset[me];
    rs_status_t st;
    if (!f.parts)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    /* (a byte more: an empty block still gets a buffer to point into) */
    RS_CHECK_GOTO(rs_scratch(comm, (size_t)size * f.bytes + 1, (void **)&slots), st, out);
    set_parts(&f, me, slots, mine, disjoint);
    RS_CHECK_GOTO(exchange(comm, buf, b, &f), st, out);
    for (int p = 0; p < size; p++)
        f.parts[p].arrived = f.bytes; /* (a copy of 0 bytes calls back no one) */
    fold_ready(&f);
    if (f.parts[0].data != mine)
        memcpy(mine, f.parts[0].data, f.bytes); /* the sends are over */
out:
    free(f.parts);
    return st;
}

rs_status_t rs_ordered_reduce_scatter(rs_comm_t *comm, char *buf, const rs_blocks_t *b,
                                      size_t elem, rs_reduce_fn fn) {
    return reduce_scatter(comm, buf, b, elem, fn, 1);
}

/* Every block is the whole buffer (count * elem: checked by the caller). */
rs_status_t rs_ordered_one_round(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                 rs_reduce_fn fn) {
    size_t *sizes = malloc(2 * (size_t)comm->size * sizeof *sizes);
    if (!sizes)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rs_blocks_t b = {sizes, sizes + comm->size};
    for (int p = 0; p < comm->size; p++)
        b.bytes[p] = count * elem, b.offset[p] = 0;
    rs_status_t st = reduce_scatter(comm, buf, &b, elem, fn, 0);
    free(sizes);
    return st;
}

rs_status_t rs_ordered_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                 rs_reduce_fn fn) {
    rs_blocks_t b;
    RS_CHECK(rs_blocks_even(comm, count, comm->size, elem, &b));
    rs_status_t st;
    RS_CHECK_GOTO(rs_ordered_reduce_scatter(comm, buf, &b, elem, fn), st, out);
    rs_group_t all = rs_group_all(comm);
    st = rs_ring_allgather(comm, &all, buf, &b);
out:
    free(b.bytes);
    return st;
}
