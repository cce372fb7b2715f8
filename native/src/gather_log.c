/* Allgatherv in ceil(log2 N) rounds, for any rank count and any per-rank counts (zeros
 * included), over the transport table like every algorithm. A power-of-two N takes
 * recursive doubling: in round k each rank swaps the 2^k blocks it holds with rank ^ 2^k,
 * in place in the result; the partners are then those of the small allreduce and the
 * barrier, log2 N of them (connections are made to the peers the algorithms need).
 * Other N take Bruck et al.'s rounds (1997):
 *
 * This rank keeps the blocks it holds in a work buffer in *rotated* order: its own
 * block first, then rank+1's, rank+2's, ... (mod N). After round k it holds the 2^(k+1)
 * blocks starting at its own. In round k (distance d = 2^k) it sends its first
 * min(d, N - d) blocks to rank - d and receives rank + d's first min(d, N - d) blocks,
 * which are exactly the next ones in its rotated order, so they land right after the d
 * it holds. Every rank knows every count, so each side computes the byte ranges itself;
 * nothing about sizes crosses the wire. A final rotation puts the blocks in rank order.
 *
 * Each rank sends N - 1 blocks' worth for equal counts, as the ring does, but in
 * ceil(log2 N) steps instead of N - 1: the engine's negotiation (a small gather every
 * round) then costs O(log N) latencies. */
#include <stdlib.h>
#include <string.h>

#include "checked.h"
#include "gather_log.h"
#include "progress.h"

static int wrap(int a, int n) { return ((a % n) + n) % n; }

/* Checked bytes of every rank's block, and their total. */
static rs_status_t block_bytes(rs_comm_t *comm, const int64_t *counts, size_t elem_bytes,
                               int64_t *bytes, int64_t *total) {
    *total = 0;
    if (elem_bytes > (size_t)RS_MAX_BYTES)
        return rs_fail(comm, RS_ERR_USAGE, "rank %d: allgather element of %zu bytes is too "
                       "large", comm->rank, elem_bytes);
    for (int i = 0; i < comm->size; i++) {
        if (counts[i] < 0)
            return rs_fail(comm, RS_ERR_USAGE, "rank %d: negative count %lld for rank %d",
                           comm->rank, (long long)counts[i], i);
        if (rs_mul_checked(counts[i], (int64_t)elem_bytes, &bytes[i]) != 0 ||
            rs_add_checked(*total, bytes[i], total) != 0)
            return rs_fail(comm, RS_ERR_USAGE, "rank %d: allgather of %lld elements of %zu "
                           "bytes from rank %d makes the total overflow", comm->rank,
                           (long long)counts[i], elem_bytes, i);
    }
    return RS_OK;
}

rs_status_t rs_gather_total(rs_comm_t *comm, const int64_t *counts, size_t elem_bytes,
                            size_t *total) {
    int64_t *bytes = malloc((size_t)comm->size * sizeof *bytes), sum = 0;
    if (!bytes)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rs_status_t st = block_bytes(comm, counts, elem_bytes, bytes, &sum);
    free(bytes);
    *total = (size_t)sum;
    return st;
}

/* at[i]: where the i-th block of this rank's rotated order starts (at[N]: the total). */
static rs_status_t rotated_offsets(rs_comm_t *comm, const int64_t *counts, size_t elem_bytes,
                                   size_t *at) {
    int n = comm->size;
    int64_t *bytes = malloc((size_t)n * sizeof *bytes), total;
    if (!bytes)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rs_status_t st = block_bytes(comm, counts, elem_bytes, bytes, &total);
    at[0] = 0;
    for (int i = 0; st == RS_OK && i < n; i++)
        at[i + 1] = at[i] + (size_t)bytes[wrap(comm->rank + i, n)]; /* <= total: no wrap */
    free(bytes);
    return st;
}

static rs_status_t bruck_rounds(rs_comm_t *comm, char *work, const size_t *at) {
    int n = comm->size;
    for (int d = 1; d < n; d *= 2) {
        int blocks = d < n - d ? d : n - d;
        rs_xfer_t x[2] = {rs_send_to(wrap(comm->rank - d, n), work, at[blocks]),
                          rs_recv_from(wrap(comm->rank + d, n), work + at[d],
                                       at[d + blocks] - at[d])};
        RS_CHECK(rs_progress(comm, x, 2));
        if (d > n / 2)
            break; /* (d * 2 would overflow an int near INT_MAX ranks) */
    }
    return RS_OK;
}

/* Recursive doubling in place: blocks in rank order at their offsets `at` (at[N]: the
 * total). Before round d, a rank holds the d blocks of its aligned group of d ranks. */
static rs_status_t doubling_rounds(rs_comm_t *comm, char *out, const size_t *at) {
    int n = comm->size, me = comm->rank;
    for (int d = 1; d < n; d *= 2) {
        int mine = me & ~(d - 1), theirs = mine ^ d;
        rs_xfer_t x[2] = {rs_send_to(me ^ d, out + at[mine], at[mine + d] - at[mine]),
                          rs_recv_from(me ^ d, out + at[theirs], at[theirs + d] - at[theirs])};
        RS_CHECK(rs_progress(comm, x, 2));
        if (d > n / 2)
            break;
    }
    return RS_OK;
}

static rs_status_t allgatherv_doubling(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                                       const int64_t *counts, size_t elem_bytes) {
    int n = comm->size;
    int64_t *bytes = malloc((size_t)n * sizeof *bytes), total;
    size_t *at = malloc(((size_t)n + 1) * sizeof *at);
    rs_status_t st = bytes && at ? block_bytes(comm, counts, elem_bytes, bytes, &total)
                                 : rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    for (int i = 0; st == RS_OK && i <= n; i++)
        at[i] = i ? at[i - 1] + (size_t)bytes[i - 1] : 0;
    if (st == RS_OK) {
        size_t mine = at[comm->rank + 1] - at[comm->rank];
        if (mine && (char *)recvbuf + at[comm->rank] != sendbuf)
            memmove((char *)recvbuf + at[comm->rank], sendbuf, mine);
        st = doubling_rounds(comm, recvbuf, at);
    }
    free(bytes);
    free(at);
    return st;
}

rs_status_t rs_allgatherv_log(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                              const int64_t *counts, size_t elem_bytes) {
    int n = comm->size;
    if (n > 1 && (n & (n - 1)) == 0)
        return allgatherv_doubling(comm, sendbuf, recvbuf, counts, elem_bytes);
    size_t *at = malloc(((size_t)n + 1) * sizeof *at);
    if (!at)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rs_status_t st = rotated_offsets(comm, counts, elem_bytes, at);
    size_t total = st == RS_OK ? at[n] : 0;
    char *work = st == RS_OK ? malloc(total ? total : 1) : NULL;
    if (st == RS_OK && !work)
        st = rs_fail(comm, RS_ERR_NOMEM, "rank %d: cannot allocate %zu bytes for an "
                     "allgather", comm->rank, total);
    if (st == RS_OK) {
        if (at[1])
            memcpy(work, sendbuf, at[1]);
        st = n > 1 ? bruck_rounds(comm, work, at) : RS_OK;
    }
    if (st == RS_OK && total) {
        /* Rank order is the rotated order turned right by this rank's offset in it. */
        size_t mine = total - at[n - comm->rank]; /* bytes of ranks 0 .. rank-1 */
        memcpy((char *)recvbuf + mine, work, total - mine);
        memcpy(recvbuf, work + (total - mine), mine);
    }
    free(work);
    free(at);
    return st;
}
