/* Adasum allreduce (RS_OP_ADASUM): adaptive summation of one tensor over all ranks
 * (Maleki et al. 2020, the scheme Horovod runs on CPUs), over the transport table.
 *
 * Two vectors combine as adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b
 * (reduce.c: rs_adasum_dots, rs_adasum_combine). The ranks combine up a binary tree:
 * (0,1) and (2,3) first, then the blocks {0..1} and {2..3}, and so on.
 *
 * With P ranks, P a power of two, the tree runs as vector-halving, distance-doubling:
 * at level L = 1, 2, 4, ... each rank swaps half of its current slice with rank ^ L (the
 * "left" rank, rank & L == 0, keeps the first half), so that every element of the two
 * blocks' vectors is combined by exactly one rank. The coefficients need a.b, |a|^2 and
 * |b|^2 over the whole vectors: each rank computes them over its kept piece, and the 2L
 * ranks holding the pieces add them up. Then the slices travel back, level by level,
 * until every rank holds the whole result; each element was computed by one rank, so
 * every rank ends with the same bits.
 *
 * With n ranks and P the largest power of two <= n, rank r >= P first hands its vector
 * to rank r - P, which combines adasum(v[r - P], v[r]) itself, and gets the result back
 * at the end (Horovod refuses such rank counts). */
#include <string.h>

#include "adasum.h"
#include "progress.h"
#include "reduce.h"
#include "util.h"

/* A run of elements of the tensor: where one rank's share starts, and its length. */
typedef struct {
    size_t lo;
    size_t len;
} slice_t;

/* One Adasum allreduce in progress. `incoming` (the communicator's scratch) holds what a
 * peer sends for combining: a whole vector at most. */
typedef struct {
    rs_comm_t *comm;
    char *buf;
    size_t elem;
    rs_dtype_t dtype;
    char *incoming;
} adasum_t;

enum { MAX_LEVELS = 31 }; /* log2 of the largest power of two an int rank count holds */

static char *at(const adasum_t *s, size_t element) { return s->buf + element * s->elem; }

/* reduce.c's arithmetic refuses a dtype it does not take; rs_adasum_allreduce checks the
 * dtype first, so this is a guard, worded on the communicator (the kernels know none). */
static rs_status_t refused(const adasum_t *s) {
    return rs_fail(s->comm, RS_ERR_USAGE, "rank %d: Adasum cannot reduce %s elements",
                   s->comm->rank, rs_dtype_name(s->dtype));
}

static rs_status_t dots(const adasum_t *s, const void *a, const void *b, size_t count,
                        double sums[3]) {
    return rs_adasum_dots(a, b, count, s->dtype, sums) == RS_OK ? RS_OK : refused(s);
}

static rs_status_t combine(const adasum_t *s, void *out, const void *a, const void *b,
                           size_t count, const double sums[3]) {
    return rs_adasum_combine(out, a, b, count, s->dtype, sums) == RS_OK ? RS_OK : refused(s);
}

/* Send out_bytes from `out` to peer while receiving in_bytes from it into `in`. */
static rs_status_t swap_with(rs_comm_t *comm, int peer, const void *out, size_t out_bytes,
                             void *in, size_t in_bytes) {
    rs_xfer_t x[2] = {rs_send_to(peer, out, out_bytes), rs_recv_from(peer, in, in_bytes)};
    return rs_progress(comm, x, 2);
}

/* Add up sums[3] over the 2 * level ranks that share this rank's bits above `level`, by
 * recursive doubling. Both partners of a step add the lower rank's sums first, so every
 * rank of the group ends with the same bits (and so the same coefficients). */
static rs_status_t group_sum(rs_comm_t *comm, int level, double sums[3]) {
    for (int d = 1; d <= level; d <<= 1) {
        int peer = comm->rank ^ d;
        double theirs[3];
        RS_CHECK(swap_with(comm, peer, sums, sizeof theirs, theirs, sizeof theirs));
        const double *low = comm->rank < peer ? sums : theirs;
        const double *high = comm->rank < peer ? theirs : sums;
        double total[3] = {low[0] + high[0], low[1] + high[1], low[2] + high[2]};
        memcpy(sums, total, sizeof total);
    }
    return RS_OK;
}

/* One level of the halving: swap half of `mine` with rank ^ level, combine the kept half
 * with the partner's copy of it, and keep that half as this rank's share. The left rank
 * holds the left block's vector (a), the right rank the right block's (b). */
static rs_status_t halve(adasum_t *s, int level, slice_t *mine) {
    int peer = s->comm->rank ^ level, left = (s->comm->rank & level) == 0;
    size_t first = mine->len / 2;
    slice_t low = {mine->lo, first}, high = {mine->lo + first, mine->len - first};
    slice_t keep = left ? low : high, give = left ? high : low;
    char *kept = at(s, keep.lo);
    RS_CHECK(swap_with(s->comm, peer, at(s, give.lo), give.len * s->elem, s->incoming,
                       keep.len * s->elem));
    const void *a = left ? kept : s->incoming, *b = left ? s->incoming : kept;
    double sums[3];
    RS_CHECK(dots(s, a, b, keep.len, sums));
    RS_CHECK(group_sum(s->comm, level, sums));
    RS_CHECK(combine(s, kept, a, b, keep.len, sums));
    *mine = keep;
    return RS_OK;
}

/* Vector-halving, distance-doubling over ranks 0..pow2-1, then the slices back to all. */
static rs_status_t halving_doubling(adasum_t *s, int pow2, size_t count) {
    slice_t parents[MAX_LEVELS], mine = {0, count};
    int levels = 0;
    for (int level = 1; level < pow2; level <<= 1) {
        parents[levels++] = mine;
        RS_CHECK(halve(s, level, &mine));
    }
    for (int level = pow2 >> 1; level >= 1; level >>= 1) {
        slice_t parent = parents[--levels];
        /* the partner's share is the rest of the parent slice, before or after ours */
        slice_t theirs = mine.lo == parent.lo
                             ? (slice_t){parent.lo + mine.len, parent.len - mine.len}
                             : (slice_t){parent.lo, parent.len - mine.len};
        RS_CHECK(swap_with(s->comm, s->comm->rank ^ level, at(s, mine.lo), mine.len * s->elem,
                           at(s, theirs.lo), theirs.len * s->elem));
        mine = parent;
    }
    return RS_OK;
}

/* Rank r < n - pow2: take in rank r + pow2's vector as the b of adasum(mine, theirs). */
static rs_status_t fold_in(adasum_t *s, int from, size_t count) {
    rs_xfer_t x = rs_recv_from(from, s->incoming, count * s->elem);
    RS_CHECK(rs_progress(s->comm, &x, 1));
    double sums[3];
    RS_CHECK(dots(s, s->buf, s->incoming, count, sums));
    return combine(s, s->buf, s->buf, s->incoming, count, sums);
}

static rs_status_t send_whole(adasum_t *s, int to, size_t count) {
    rs_xfer_t x = rs_send_to(to, s->buf, count * s->elem);
    return rs_progress(s->comm, &x, 1);
}

static rs_status_t receive_whole(adasum_t *s, int from, size_t count) {
    rs_xfer_t x = rs_recv_from(from, s->buf, count * s->elem);
    return rs_progress(s->comm, &x, 1);
}

static int largest_power_of_two_upto(int n) {
    int p = 1;
    while (p <= n / 2)
        p <<= 1;
    return p;
}

rs_status_t rs_adasum_allreduce(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype) {
    if (!rs_dtype_is_float(dtype))
        return rs_fail(comm, RS_ERR_USAGE, "rank %d: dtype %s is not supported by the Adasum "
                       "op; it takes float16, bfloat16, float32 or float64", comm->rank,
                       rs_dtype_name(dtype));
    if (comm->size == 1 || count == 0)
        return RS_OK;
    adasum_t s = {comm, buf, rs_dtype_size(dtype), dtype, NULL};
    RS_CHECK(rs_scratch(comm, count * s.elem, (void **)&s.incoming));
    int pow2 = largest_power_of_two_upto(comm->size), rank = comm->rank;
    if (rank >= pow2) { /* an extra rank: rank - pow2 combines for it */
        RS_CHECK(send_whole(&s, rank - pow2, count));
        return receive_whole(&s, rank - pow2, count);
    }
    int extra = rank + pow2 < comm->size ? rank + pow2 : -1;
    if (extra >= 0)
        RS_CHECK(fold_in(&s, extra, count));
    RS_CHECK(halving_doubling(&s, pow2, count));
    return extra >= 0 ? send_whole(&s, extra, count) : RS_OK;
}
