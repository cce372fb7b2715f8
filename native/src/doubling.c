/* Collectives whose cost is latency, not bytes, in ceil(log2 N) rounds: a rank exchanges
 * with log2 N partners (rank ^ 2^k), not with every peer, so a job of thousands of ranks
 * keeps a few connections per rank and a few round trips per call. */
#include <stdlib.h>
#include <string.h>

#include "doubling.h"
#include "progress.h"

static int largest_power_of_two(int n) {
    int p = 1;
    while (p <= n / 2)
        p *= 2;
    return p;
}

static rs_status_t swap(rs_comm_t *comm, int peer, const char *out, char *in, size_t bytes) {
    rs_xfer_t x[2] = {rs_send_to(peer, out, bytes), rs_recv_from(peer, in, bytes)};
    return rs_progress(comm, x, 2);
}

/* Fold the partner's partial `theirs` into mine, the lower rank's partial first, so that
 * both ends compute the same bits. */
static void fold(char *mine, char *theirs, size_t count, size_t elem, int mine_is_lower,
                 rs_reduce_fn fn) {
    if (mine_is_lower) {
        fn(mine, theirs, count);
        return;
    }
    fn(theirs, mine, count);
    memcpy(mine, theirs, count * elem);
}

static rs_status_t doubling_rounds(rs_comm_t *comm, char *buf, char *tmp, size_t count,
                                   size_t elem, int p2, rs_reduce_fn fn) {
    int me = comm->rank;
    for (int d = 1; d < p2; d *= 2) {
        RS_CHECK(swap(comm, me ^ d, buf, tmp, count * elem));
        fold(buf, tmp, count, elem, me < (me ^ d), fn);
    }
    return RS_OK;
}

rs_status_t rs_doubling_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                  rs_reduce_fn fn) {
    int n = comm->size, me = comm->rank, p2 = largest_power_of_two(n);
    size_t bytes = count * elem;
    if (me >= p2) { /* folded into rank me - p2's partial; its result comes back */
        rs_xfer_t out = rs_send_to(me - p2, buf, bytes);
        RS_CHECK(rs_progress(comm, &out, 1));
        rs_xfer_t in = rs_recv_from(me - p2, buf, bytes);
        return rs_progress(comm, &in, 1);
    }
    char *tmp = malloc(bytes ? bytes : 1);
    if (!tmp)
        return rs_fail(comm, RS_ERR_NOMEM, "rank %d: cannot allocate %zu bytes for an "
                       "allreduce", me, bytes);
    rs_status_t st = RS_OK;
    if (me + p2 < n) {
        rs_xfer_t in = rs_recv_from(me + p2, tmp, bytes);
        st = rs_progress(comm, &in, 1);
        if (st == RS_OK)
            fn(buf, tmp, count);
    }
    if (st == RS_OK)
        st = doubling_rounds(comm, buf, tmp, count, elem, p2, fn);
    if (st == RS_OK && me + p2 < n) {
        rs_xfer_t out = rs_send_to(me + p2, buf, bytes);
        st = rs_progress(comm, &out, 1);
    }
    free(tmp);
    return st;
}

/* Ranks are numbered from the root (v = rank - root mod N). Rank v receives from v
 * without its lowest set bit, and sends to v + 2^k for every 2^k below that bit. */
rs_status_t rs_binomial_broadcast(rs_comm_t *comm, void *buf, size_t bytes, int root) {
    int n = comm->size, v = (comm->rank - root + n) % n, low = 1;
    while (low < n && !(v & low))
        low *= 2;
    if (v != 0) {
        rs_xfer_t in = rs_recv_from((v - low + root) % n, buf, bytes);
        RS_CHECK(rs_progress(comm, &in, 1));
    }
    rs_xfer_t out[32];
    int k = 0;
    for (int d = low / 2; d >= 1; d /= 2)
        if (v + d < n)
            out[k++] = rs_send_to((v + d + root) % n, buf, bytes);
    return rs_progress(comm, out, k);
}
