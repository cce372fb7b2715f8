#define _GNU_SOURCE
/* Running negotiated tensors: neighbouring allreduces with the same dtype, op and scale
 * factors are packed into one fusion buffer and reduced in one ring pass. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "execute.h"
#include "progress.h"
#include "util.h"

static int64_t row_elements(const rs_meta_t *m) {
    int64_t n = 1;
    for (int d = 1; d < m->ndim; d++)
        n *= m->shape[d];
    return n;
}

static int64_t elements(const rs_meta_t *m) {
    if (m->kind == RS_KIND_TUNE)
        return 0; /* its "shape" holds settings */
    return m->ndim == 0 ? 1 : m->shape[0] * row_elements(m);
}

static size_t tensor_bytes(const rs_meta_t *m) {
    return (size_t)elements(m) * rs_dtype_size(m->dtype);
}

static void span(rs_executor_t *x, const rs_pending_t *p, rs_span_t phase, double start) {
    if (x->timeline->file)
        rs_timeline_span(x->timeline, p->metas[p->last_rank].kind, p->name, phase, start,
                         rs_now());
}

/* ---- allreduce, fused ---- */

static int fusable(const rs_executor_t *x, const rs_pending_t *a, const rs_pending_t *b,
                   size_t fused_bytes) {
    const rs_meta_t *ma = &a->metas[0], *mb = &b->metas[0];
    /* Adasum's coefficients are per tensor: a fusion would compute them over several */
    return x->fusion_threshold > 0 && mb->kind == RS_KIND_ALLREDUCE && ma->op != RS_OP_ADASUM &&
           ma->dtype == mb->dtype && ma->op == mb->op && ma->prescale == mb->prescale &&
           ma->postscale == mb->postscale &&
           fused_bytes + tensor_bytes(mb) <= (size_t)x->fusion_threshold;
}

/* Where every rank is on this host, large allreduces go through the shared segments
 * (each byte read from a peer once) instead of the ring; Adasum, an exchange between
 * pairs of ranks and no element-wise sum, always takes rs_allreduce's own algorithm.
 * (x->staged exists only with every rank on one host; across hosts rs_allreduce picks
 * the ring or the hierarchical allreduce.) */
static rs_status_t reduce_buffer(rs_executor_t *x, const void *send, void *recv, size_t count,
                                 const rs_meta_t *m) {
    if (!x->staged || m->op == RS_OP_ADASUM ||
        count * rs_dtype_size(m->dtype) < x->staged_min_bytes)
        return rs_allreduce(x->comm, send, recv, count, m->dtype, m->op, m->prescale,
                            m->postscale);
    rs_status_t st = rs_lane_staged_allreduce(x->staged, send, recv, count, m);
    const rs_error_t *why = rs_lane_error(x->staged); /* the engine thread's instance */
    if (st != RS_OK && why->code != RS_OK)
        rs_fail(x->comm, st, "%s", why->text);
    return st;
}

static rs_status_t allreduce_one(rs_executor_t *x, rs_pending_t *p) {
    const rs_meta_t *m = &p->metas[0];
    double start = rs_now();
    rs_status_t st = reduce_buffer(x, p->mine->sendbuf, p->mine->recvbuf, (size_t)elements(m),
                                   m);
    span(x, p, RS_SPAN_RUN, start);
    return st;
}

static rs_status_t fusion_buffer(rs_executor_t *x, size_t bytes, char **out) {
    if (bytes > x->fusion_bytes) {
        void *grown = realloc(x->fusion, bytes);
        if (!grown)
            return rs_fail(x->comm, RS_ERR_NOMEM, "cannot allocate a %zu-byte fusion buffer", bytes);
        x->fusion = grown;
        x->fusion_bytes = bytes;
    }
    *out = x->fusion;
    return RS_OK;
}

static rs_status_t allreduce_fused(rs_executor_t *x, rs_pending_t **group, int n, size_t bytes) {
    const rs_meta_t *m = &group[0]->metas[0];
    char *fused = NULL;
    RS_CHECK(fusion_buffer(x, bytes, &fused));
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        double start = rs_now();
        size_t b = tensor_bytes(&group[i]->metas[0]);
        memcpy(fused + at, group[i]->mine->sendbuf, b);
        at += b;
        span(x, group[i], RS_SPAN_COPY_IN, start);
    }
    double start = rs_now();
    RS_CHECK(reduce_buffer(x, fused, fused, bytes / rs_dtype_size(m->dtype), m));
    for (int i = 0; i < n; i++)
        span(x, group[i], RS_SPAN_RUN, start);
    at = 0;
    for (int i = 0; i < n; i++) {
        start = rs_now();
        size_t b = tensor_bytes(&group[i]->metas[0]);
        memcpy(group[i]->mine->recvbuf, fused + at, b);
        at += b;
        span(x, group[i], RS_SPAN_COPY_OUT, start);
    }
    return RS_OK;
}

/* ---- the other collectives ---- */

static rs_status_t run_allgather(rs_executor_t *x, rs_pending_t *p) {
    rs_comm_t *comm = x->comm;
    const rs_meta_t *m = &p->metas[comm->rank];
    size_t elem = rs_dtype_size(m->dtype);
    int64_t *counts = malloc((size_t)comm->size * sizeof *counts), rows = 0;
    if (!counts)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    for (int r = 0; r < comm->size; r++) {
        counts[r] = p->metas[r].shape[0] * row_elements(m);
        rows += p->metas[r].shape[0];
    }
    size_t bytes = (size_t)(rows * row_elements(m)) * elem;
    void *out = rs_malloc_large(bytes);
    double start = rs_now();
    rs_status_t st;
    if (!out)
        RS_CHECK_GOTO(rs_fail(comm, RS_ERR_NOMEM, "cannot allocate %zu bytes", bytes), st, done);
    RS_CHECK_GOTO(rs_allgatherv(comm, p->mine->sendbuf, out, counts, elem), st, done);
    p->mine->result = out;
    p->mine->result_rows = rows;
    out = NULL; /* the request's now */
done:
    span(x, p, RS_SPAN_RUN, start);
    free(counts);
    free(out);
    return st;
}

/* Every rank's row count for us, and the bytes they come to (refused if more than can be
 * received: the counts are a peer's word). */
static rs_status_t alltoall_counts(rs_executor_t *x, rs_pending_t *p, size_t row_bytes,
                                   int64_t *eights, int64_t *recv_rows, int64_t *recv_bytes,
                                   int64_t *total) {
    rs_comm_t *comm = x->comm;
    for (int r = 0; r < comm->size; r++)
        eights[r] = 8;
    RS_CHECK(rs_alltoallv(comm, p->mine->splits, eights, recv_rows, eights));
    *total = 0;
    for (int r = 0; r < comm->size; r++)
        if (rs_mul_checked(recv_rows[r], (int64_t)row_bytes, &recv_bytes[r]) != 0 ||
            rs_add_checked(*total, recv_bytes[r], total) != 0)
            return rs_fail(comm, RS_ERR_COMM, "rank %d: alltoall '%s': rank %d announced %lld "
                           "rows of %zu bytes, more than can be received", comm->rank, p->name,
                           r, (long long)recv_rows[r], row_bytes);
    return RS_OK;
}

/* Tell every rank how many rows it receives from us, then move the rows. */
static rs_status_t run_alltoall(rs_executor_t *x, rs_pending_t *p) {
    rs_comm_t *comm = x->comm;
    rs_work_t *w = p->mine;
    size_t n = (size_t)comm->size, row_bytes = (size_t)row_elements(&w->meta) *
                                                rs_dtype_size(w->meta.dtype);
    int64_t *eights = malloc(n * 8), *recv_rows = malloc(n * 8), *send_bytes = malloc(n * 8),
            *recv_bytes = malloc(n * 8), total = 0, rows = 0;
    void *out = NULL;
    double start = rs_now();
    rs_status_t st;
    if (!eights || !recv_rows || !send_bytes || !recv_bytes)
        RS_CHECK_GOTO(rs_fail(comm, RS_ERR_NOMEM, "out of memory"), st, done);
    RS_CHECK_GOTO(alltoall_counts(x, p, row_bytes, eights, recv_rows, recv_bytes, &total), st,
                  done);
    for (size_t r = 0; r < n; r++) {
        send_bytes[r] = w->splits[r] * (int64_t)row_bytes; /* validated at submission */
        rows += recv_rows[r];
    }
    if (!(out = malloc((size_t)total + 1)))
        RS_CHECK_GOTO(rs_fail(comm, RS_ERR_NOMEM, "out of memory"), st, done);
    RS_CHECK_GOTO(rs_alltoallv(comm, w->sendbuf, send_bytes, out, recv_bytes), st, done);
    w->result = out;
    w->result_rows = rows;
    w->result_splits = recv_rows;
    out = recv_rows = NULL; /* the request's now */
done:
    span(x, p, RS_SPAN_RUN, start);
    free(eights);
    free(send_bytes);
    free(recv_bytes);
    free(recv_rows);
    free(out);
    return st;
}

static rs_status_t run_reducescatter(rs_executor_t *x, rs_pending_t *p) {
    rs_comm_t *comm = x->comm;
    const rs_meta_t *m = &p->metas[0];
    int64_t *counts = malloc((size_t)comm->size * sizeof *counts);
    if (!counts)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    for (int r = 0; r < comm->size; r++) {
        size_t offset, rows;
        rs_even_part((size_t)m->shape[0], comm->size, r, &offset, &rows);
        counts[r] = (int64_t)rows * row_elements(m);
    }
    double start = rs_now();
    rs_status_t st = rs_reducescatter(comm, p->mine->sendbuf, p->mine->recvbuf, counts, m->dtype,
                                      m->op, m->prescale, m->postscale);
    span(x, p, RS_SPAN_RUN, start);
    free(counts);
    return st;
}

/* Every rank applies a tune request at the same place of the agreed order, so the
 * tensors after it fuse and choose algorithms alike everywhere. The lane reads the
 * one-round size on calling threads: an atomic store (a call that sees the old value
 * on one rank and the new one on another goes to the engine, see agreed_flags). */
static void apply_settings(rs_executor_t *x, const rs_meta_t *m) {
    x->fusion_threshold = m->shape[RS_TUNE_FUSION_THRESHOLD];
    x->cycle_time_ms = (double)m->shape[RS_TUNE_CYCLE_TIME_US] * 1e-3;
    x->staged_min_bytes = (size_t)m->shape[RS_TUNE_STAGED_BYTES];
    __atomic_store_n(&x->comm->small_allreduce_bytes, (size_t)m->shape[RS_TUNE_SMALL_ALLREDUCE],
                     __ATOMIC_RELAXED);
    for (int i = 0; i < RS_TUNE_COUNT; i++)
        __atomic_store_n(&x->settings[i], m->shape[i], __ATOMIC_RELAXED);
}

static rs_status_t run_single(rs_executor_t *x, rs_pending_t *p) {
    const rs_meta_t *m = &p->metas[0];
    double start = rs_now();
    switch (m->kind) {
    case RS_KIND_ALLREDUCE:
        return allreduce_one(x, p);
    case RS_KIND_BROADCAST: {
        rs_status_t st = rs_broadcast(x->comm, p->mine->recvbuf, tensor_bytes(m), m->root);
        span(x, p, RS_SPAN_RUN, start);
        return st;
    }
    case RS_KIND_ALLGATHER:
        return run_allgather(x, p);
    case RS_KIND_ALLTOALL:
        return run_alltoall(x, p);
    case RS_KIND_REDUCESCATTER:
        return run_reducescatter(x, p);
    case RS_KIND_TUNE:
        apply_settings(x, m);
        return RS_OK;
    default: /* barrier: negotiation already proved that every rank got here */
        return RS_OK;
    }
}

/* Once a collective's bytes may be moving, a failure on one rank (even out of memory)
 * leaves its peers streaming data that this rank will not read, or will misread as the
 * next negotiation: the communicator is broken on every rank (the engine aborts it, which
 * tells the peers), and nothing is returned as valid. */
static rs_status_t settle(rs_executor_t *x, rs_pending_t **group, int n, rs_status_t st) {
    rs_error_t why;
    if (st != RS_OK && st != RS_ERR_COMM && st != RS_ERR_TIMEOUT) {
        rs_comm_error(x->comm, &why);
        st = rs_fail(x->comm, RS_ERR_COMM, "rank %d: %s '%s' failed while running (%s); the "
                     "communicator is broken, its peers may be mid-transfer",
                     x->comm->rank, rs_kind_name(group[0]->mine->meta.kind), group[0]->name,
                     why.text);
    }
    if (st != RS_OK)
        rs_comm_error(x->comm, &why);
    for (int i = 0; i < n; i++) {
        group[i]->mine->status = st;
        if (st != RS_OK)
            group[i]->mine->error = strdup(why.text);
    }
    return st;
}

/* ---- point-to-point messages (see "point-to-point" in submit.c) ----
 *
 * Negotiation proved that both ends posted a message with the same dtype and shape, so
 * the receiver's buffer takes exactly the bytes the sender sends. Every rank meets a run
 * of ready messages at the same place in the agreed order, so their bytes sit between the
 * same collectives' bytes on both ends of each stream. Within a run, this rank moves its
 * messages in waves, each wave's transfers at once (a ring exchange costs one transfer's
 * time, not one per rank): a wave ends before a message on a stream (peer and direction)
 * it already uses, so a stream's messages keep their order. No deadlock: waves are
 * consecutive pieces of the agreed order, so a transfer waits only for earlier ones, and
 * the earliest unfinished message has both its ends at it. */
#define P2P_WAVE_MAX 64

static int same_stream(const rs_xfer_t *a, const rs_xfer_t *b) {
    return a->peer == b->peer && a->is_send == b->is_send;
}

/* Runs one wave from the start of ready (a run of messages); *used: how many entries it
 * settled or skipped (messages between other ranks, disagreements). */
static rs_status_t p2p_wave(rs_executor_t *x, rs_pending_t **ready, int nready, int *used) {
    rs_comm_t *comm = x->comm;
    rs_xfer_t xfers[P2P_WAVE_MAX];
    rs_pending_t *group[P2P_WAVE_MAX];
    int nx = 0, ng = 0, j = 0;
    for (; j < nready && ng < P2P_WAVE_MAX && rs_pending_is_p2p(ready[j]); j++) {
        rs_pending_t *q = ready[j];
        if (!q->mine)
            continue; /* between two other ranks */
        char *disagreement = rs_check_agreement(q, comm->size);
        if (disagreement) { /* both ends find it: each fails it, no byte moves */
            q->mine->status = RS_ERR_USAGE;
            q->mine->error = disagreement;
            continue;
        }
        const rs_meta_t *m = &q->metas[comm->rank];
        size_t bytes = tensor_bytes(m);
        rs_xfer_t t = comm->rank == m->root ? rs_send_to(m->op, q->mine->sendbuf, bytes)
                                            : rs_recv_from(m->root, q->mine->recvbuf, bytes);
        int clash = 0;
        for (int k = 0; k < nx && bytes; k++)
            clash |= same_stream(&xfers[k], &t);
        if (clash)
            break; /* it starts the next wave */
        if (bytes)
            xfers[nx++] = t;
        group[ng++] = q;
    }
    *used = j;
    double start = rs_now();
    rs_status_t st = nx ? rs_progress(comm, xfers, nx) : RS_OK;
    for (int k = 0; k < ng; k++)
        span(x, group[k], comm->rank == group[k]->metas[comm->rank].root ? RS_SPAN_SEND : RS_SPAN_RECV,
             start);
    return ng ? settle(x, group, ng, st) : st;
}

rs_status_t rs_execute(rs_executor_t *x, rs_pending_t **ready, int nready) {
    int i = 0;
    while (i < nready) {
        rs_pending_t *p = ready[i];
        if (rs_pending_is_p2p(p)) {
            int used;
            RS_CHECK(p2p_wave(x, ready + i, nready - i, &used));
            i += used;
            continue;
        }
        char *disagreement = rs_check_agreement(p, x->comm->size);
        if (disagreement) { /* every rank finds the same: each fails it alike */
            p->mine->status = RS_ERR_USAGE;
            p->mine->error = disagreement;
            i++;
            continue;
        }
        int n = 1;
        size_t bytes = tensor_bytes(&p->metas[0]);
        if (p->metas[0].kind == RS_KIND_ALLREDUCE) {
            while (i + n < nready && fusable(x, p, ready[i + n], bytes)) {
                char *other = rs_check_agreement(ready[i + n], x->comm->size);
                if (other) {
                    free(other);
                    break; /* it fails on its own in the next round of this loop */
                }
                bytes += tensor_bytes(&ready[i + n]->metas[0]);
                n++;
            }
        }
        rs_status_t st = n > 1 ? allreduce_fused(x, ready + i, n, bytes) : run_single(x, p);
        RS_CHECK(settle(x, ready + i, n, st));
        i += n;
    }
    return RS_OK;
}
