/* Collective algorithms over a transport table. They see only the communicator's
 * rank, size and transfers to peers; the transport decides how bytes move. */
#include <stdlib.h>
#include <string.h>

#include "adasum.h"
#include "algorithms.h"
#include "checked.h"
#include "doubling.h"
#include "gather_log.h"
#include "hierarchical.h"
#include "ordered.h"
#include "reduce.h"
#include "ring.h"
#include "util.h"

static int mod(int a, int n) { return ((a % n) + n) % n; }

/* Up to this many ranks a small allreduce exchanges whole buffers with every peer in one
 * round; past it, recursive doubling (log2 N rounds, log2 N partners). Thread ranks on
 * one 2-core host over loopback TCP (raw communicators), median us, one round / doubling:
 *   4 bytes: N=3 47/73, N=4 95/109, N=5 124/133, N=6 183/145, N=8 338/221, N=16 1194/390
 *   4 KiB:   N=3 55/60, N=4 123/70,  N=5 167/89,  N=6 253/123, N=8 518/153, N=16 1479/415
 * (the one round also connects every pair, which past a few dozen ranks costs more) */
#define RS_ONE_ROUND_MAX_RANKS 4
/* Broadcasts up to this size go down a binomial tree, larger ones along the chain. */
#define RS_TREE_BROADCAST_BYTES ((size_t)64 << 10)
static int left_of(const rs_comm_t *c) { return mod(c->rank - 1, c->size); }
static int right_of(const rs_comm_t *c) { return mod(c->rank + 1, c->size); }

static rs_status_t blocks_from_counts(rs_comm_t *comm, const int64_t *counts, size_t unit,
                                      rs_blocks_t *b, size_t *total) {
    b->bytes = malloc(2 * (size_t)comm->size * sizeof(size_t));
    if (!b->bytes)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    b->offset = b->bytes + comm->size;
    size_t at = 0;
    for (int i = 0; i < comm->size; i++) {
        if (counts[i] < 0) {
            free(b->bytes);
            b->bytes = NULL; /* nothing for the caller to free */
            return rs_fail(comm, RS_ERR_USAGE, "rank %d: negative count %lld for rank %d",
                           comm->rank, (long long)counts[i], i);
        }
        b->offset[i] = at;
        b->bytes[i] = (size_t)counts[i] * unit;
        at += b->bytes[i];
    }
    *total = at;
    return RS_OK;
}

static rs_status_t check_reduction_args(rs_comm_t *comm, rs_dtype_t dtype, rs_op_t op) {
    if (!rs_dtype_valid(dtype))
        return rs_fail(comm, RS_ERR_USAGE, "unsupported dtype code %d", (int)dtype);
    if (!rs_op_valid(op))
        return rs_fail(comm, RS_ERR_USAGE, "unsupported reduction op code %d", (int)op);
    if (!rs_op_takes_dtype(op, dtype))
        return rs_fail(comm, RS_ERR_USAGE, "dtype %s is not supported by the %s op",
                       rs_dtype_name(dtype), rs_op_name(op));
    return RS_OK;
}

/* The kernels have no communicator, so no record: their failures are worded here (a
 * dtype they cannot scale; the collectives check dtypes first, so this is a guard). */
static rs_status_t cannot_scale(rs_comm_t *comm, rs_dtype_t dtype, const char *how) {
    return rs_fail(comm, RS_ERR_USAGE, "rank %d: cannot %s %s elements", comm->rank, how,
                   rs_dtype_name(dtype));
}

rs_status_t rs_scale(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype,
                     double factor) {
    if (rs_scale_local(buf, count, dtype, factor) != RS_OK)
        return cannot_scale(comm, dtype, "scale");
    return RS_OK;
}

/* Post-scaling: Average divides by the rank count, then the user's factor applies. */
rs_status_t rs_finish_scale(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype,
                            rs_op_t op, double postscale) {
    double factor = postscale;
    if (op == RS_OP_AVERAGE && rs_dtype_is_integer(dtype)) {
        if (rs_divide_local(buf, count, dtype, comm->size) != RS_OK)
            return cannot_scale(comm, dtype, "average");
    } else if (op == RS_OP_AVERAGE) {
        factor /= comm->size;
    }
    return factor == 1.0 ? RS_OK : rs_scale(comm, buf, count, dtype, factor);
}

/* ---- allreduce algorithms (ring.c, hierarchical.c, ordered.c) ---- */

/* Which algorithm reduces `count` elements across the ranks. Deterministic: only the
 * rank-order ones (one round for small buffers, else even blocks), which give the same
 * bits at any size. Otherwise hierarchical forced on takes every allreduce (what
 * Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE=1 means); small buffers go in one round, and
 * large ones hierarchically where the topology allows and they reach its threshold, else
 * around the flat ring. Every rank picks the same: the settings are agreed, the topology
 * comes from the same host names. */
static rs_status_t allreduce_among_ranks(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                         rs_reduce_fn fn) {
    size_t bytes = count * elem; /* checked by the caller */
    size_t small = __atomic_load_n(&comm->small_allreduce_bytes, __ATOMIC_RELAXED);
    if (comm->deterministic)
        return bytes <= small ? rs_ordered_one_round(comm, buf, count, elem, fn)
                              : rs_ordered_allreduce(comm, buf, count, elem, fn);
    int hierarchical = rs_hierarchical_chosen(comm, bytes);
    int forced = hierarchical && comm->hierarchical_mode == RS_HIERARCHICAL_ON;
    if (!forced && bytes <= small && comm->size <= RS_ONE_ROUND_MAX_RANKS)
        return rs_ordered_one_round(comm, buf, count, elem, fn);
    if (!forced && bytes <= small)
        return rs_doubling_allreduce(comm, buf, count, elem, fn);
    if (hierarchical)
        return rs_hierarchical_allreduce(comm, buf, count, elem, fn);
    rs_group_t all = rs_group_all(comm);
    return rs_ring_allreduce(comm, &all, buf, count, elem, fn);
}

/* ---- public collectives ---- */

rs_status_t rs_allreduce(rs_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count,
                         rs_dtype_t dtype, rs_op_t op, double prescale, double postscale) {
    RS_CHECK(check_reduction_args(comm, dtype, op));
    size_t elem = rs_dtype_size(dtype);
    if (count > (size_t)RS_MAX_BYTES / elem)
        return rs_fail(comm, RS_ERR_USAGE, "rank %d: allreduce of %zu %s elements is larger "
                       "than %lld bytes", comm->rank, count, rs_dtype_name(dtype),
                       (long long)RS_MAX_BYTES);
    if (count && sendbuf != recvbuf)
        memcpy(recvbuf, sendbuf, count * elem);
    if (prescale != 1.0)
        RS_CHECK(rs_scale(comm, recvbuf, count, dtype, prescale));
    if (op == RS_OP_ADASUM)
        RS_CHECK(rs_adasum_allreduce(comm, recvbuf, count, dtype));
    else if (comm->size > 1 && count > 0)
        RS_CHECK(allreduce_among_ranks(comm, recvbuf, count, elem, rs_reduce_kernel(dtype, op)));
    return rs_finish_scale(comm, recvbuf, count, dtype, op, postscale);
}

/* The ring reduces in place, and sendbuf is the caller's: it works on a copy (the
 * hierarchical one, unscaled, copies each chunk as its pipeline reaches it, so that the
 * copy overlaps the transfers). The deterministic mode exchanges the blocks in one round
 * instead, to fold them in rank order (ordered.c). */
static rs_status_t reduce_scatter_copy(rs_comm_t *comm, const void *sendbuf, char *work,
                                       size_t total, const rs_blocks_t *b, size_t elem,
                                       rs_dtype_t dtype, rs_op_t op, double prescale) {
    rs_reduce_fn fn = rs_reduce_kernel(dtype, op);
    int hierarchical = !comm->deterministic && rs_hierarchical_chosen(comm, total);
    if (hierarchical && prescale == 1.0)
        return rs_hierarchical_reduce_scatter(comm, sendbuf == work ? NULL : sendbuf, work, b,
                                              elem, fn);
    if (sendbuf != work)
        memcpy(work, sendbuf, total);
    if (prescale != 1.0)
        RS_CHECK(rs_scale(comm, work, total / elem, dtype, prescale));
    if (comm->deterministic)
        return rs_ordered_reduce_scatter(comm, work, b, elem, fn);
    if (hierarchical)
        return rs_hierarchical_reduce_scatter(comm, NULL, work, b, elem, fn);
    rs_group_t all = rs_group_all(comm);
    return rs_ring_reduce_scatter(comm, &all, work, b, elem, fn);
}

rs_status_t rs_reducescatter(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                             const int64_t *counts, rs_dtype_t dtype, rs_op_t op,
                             double prescale, double postscale) {
    RS_CHECK(check_reduction_args(comm, dtype, op));
    if (op == RS_OP_ADASUM)
        return rs_fail(comm, RS_ERR_USAGE, "the Adasum op is only for allreduce, not "
                       "reducescatter");
    size_t elem = rs_dtype_size(dtype), total;
    rs_blocks_t b;
    RS_CHECK(blocks_from_counts(comm, counts, elem, &b, &total));
    /* In place (recvbuf == sendbuf, as MPI_IN_PLACE): the input itself is the work buffer
     * and the result lands at its start, so a large reduction needs no second copy. */
    int in_place = sendbuf == recvbuf;
    char *work = comm->size == 1 ? NULL : in_place ? recvbuf : rs_malloc_large(total);
    size_t my_bytes = b.bytes[comm->rank];
    const char *mine = work ? work + b.offset[comm->rank] : (const char *)sendbuf;
    rs_status_t st = RS_OK;
    if (comm->size > 1 && !work)
        RS_CHECK_GOTO(rs_fail(comm, RS_ERR_NOMEM, "cannot allocate %zu bytes", total), st, out);
    if (work)
        RS_CHECK_GOTO(reduce_scatter_copy(comm, sendbuf, work, total, &b, elem, dtype, op,
                                          prescale), st, out);
    if (my_bytes && recvbuf != mine)
        memmove(recvbuf, mine, my_bytes);
    if (!work && prescale != 1.0)
        RS_CHECK_GOTO(rs_scale(comm, recvbuf, my_bytes / elem, dtype, prescale), st, out);
    st = rs_finish_scale(comm, recvbuf, my_bytes / elem, dtype, op, postscale);
out:
    if (!in_place)
        free(work);
    free(b.bytes);
    return st;
}

rs_status_t rs_allgatherv(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                          const int64_t *counts, size_t elem_bytes) {
    size_t total;
    RS_CHECK(rs_gather_total(comm, counts, elem_bytes, &total));
    /* Small gathers (the engine's negotiation among them) take log2(N) rounds whatever the
     * hierarchical setting: they are latency, not bandwidth. */
    if (comm->size > 2 && total <= comm->small_gather_bytes)
        return rs_allgatherv_log(comm, sendbuf, recvbuf, counts, elem_bytes);
    rs_blocks_t b;
    RS_CHECK(blocks_from_counts(comm, counts, elem_bytes, &b, &total));
    char *mine = (char *)recvbuf + b.offset[comm->rank];
    if (b.bytes[comm->rank] && mine != sendbuf)
        memmove(mine, sendbuf, b.bytes[comm->rank]);
    rs_group_t all = rs_group_all(comm);
    rs_status_t st = RS_OK;
    if (rs_hierarchical_chosen(comm, total))
        st = rs_hierarchical_allgatherv(comm, recvbuf, &b, elem_bytes);
    else if (comm->size > 1)
        st = rs_ring_allgather(comm, &all, recvbuf, &b);
    free(b.bytes);
    return st;
}

/* Small buffers go down a binomial tree (log2 N latencies); large ones along a pipelined
 * chain from the root around the ring: each rank forwards bytes to its right neighbour as
 * soon as they arrive from its left one. */
rs_status_t rs_broadcast(rs_comm_t *comm, void *buf, size_t bytes, int root) {
    if (root < 0 || root >= comm->size)
        return rs_fail(comm, RS_ERR_USAGE, "root rank %d is out of range [0, %d)", root,
                       comm->size);
    if (comm->size == 1 || bytes == 0)
        return RS_OK;
    if (bytes <= RS_TREE_BROADCAST_BYTES && comm->size > 2)
        return rs_binomial_broadcast(comm, buf, bytes, root);
    int position = mod(comm->rank - root, comm->size);
    rs_xfer_t x[2] = {rs_recv_from(left_of(comm), buf, bytes),
                      rs_send_to(right_of(comm), buf, bytes)};
    if (position == 0)
        return rs_progress(comm, &x[1], 1);
    if (position == comm->size - 1)
        return rs_progress(comm, &x[0], 1);
    x[1].avail = &x[0].done;
    return rs_progress(comm, x, 2);
}

rs_status_t rs_alltoallv(rs_comm_t *comm, const void *sendbuf, const int64_t *send_counts,
                         void *recvbuf, const int64_t *recv_counts) {
    size_t send_total, recv_total;
    rs_blocks_t out = {0}, in = {0};
    rs_xfer_t *x = NULL;
    rs_status_t st;
    RS_CHECK_GOTO(blocks_from_counts(comm, send_counts, 1, &out, &send_total), st, done);
    RS_CHECK_GOTO(blocks_from_counts(comm, recv_counts, 1, &in, &recv_total), st, done);
    int r = comm->rank, n = comm->size;
    if (out.bytes[r] != in.bytes[r])
        RS_CHECK_GOTO(rs_fail(comm, RS_ERR_USAGE, "rank %d: alltoall sends %zu bytes to itself "
                              "but expects %zu", r, out.bytes[r], in.bytes[r]), st, done);
    if (!(x = calloc(2 * (size_t)n, sizeof *x)))
        RS_CHECK_GOTO(rs_fail(comm, RS_ERR_NOMEM, "out of memory"), st, done);
    memmove((char *)recvbuf + in.offset[r], (const char *)sendbuf + out.offset[r], in.bytes[r]);
    int k = 0;
    for (int s = 1; s < n; s++) {
        int to = mod(r + s, n), from = mod(r - s, n);
        x[k++] = rs_send_to(to, (const char *)sendbuf + out.offset[to], out.bytes[to]);
        x[k++] = rs_recv_from(from, (char *)recvbuf + in.offset[from], in.bytes[from]);
    }
    st = rs_progress(comm, x, k);
done:
    free(x);
    free(out.bytes);
    free(in.bytes);
    return st;
}

/* log2(size) rounds of one byte each: recursive doubling for a power-of-two size (the
 * partners of the other log-round collectives), else a dissemination barrier. */
rs_status_t rs_barrier(rs_comm_t *comm) {
    int n = comm->size;
    for (int k = 1; (n & (n - 1)) == 0 && k < n; k <<= 1) {
        char token = 1, incoming = 0;
        rs_xfer_t x[2] = {rs_send_to(comm->rank ^ k, &token, 1),
                          rs_recv_from(comm->rank ^ k, &incoming, 1)};
        RS_CHECK(rs_progress(comm, x, 2));
    }
    for (int k = 1; (n & (n - 1)) != 0 && k < n; k <<= 1) {
        char token = 1, incoming = 0;
        rs_xfer_t x[2] = {rs_send_to(mod(comm->rank + k, comm->size), &token, 1),
                          rs_recv_from(mod(comm->rank - k, comm->size), &incoming, 1)};
        RS_CHECK(rs_progress(comm, x, 2));
    }
    return RS_OK;
}
