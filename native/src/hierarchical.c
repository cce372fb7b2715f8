/* Hierarchical collectives: topology-aware, for communicators spanning several hosts with
 * the same number (L >= 2) of ranks on each of H hosts.
 *
 * A flat ring over all ranks crosses each host boundary with one rank's whole share of
 * the traffic: on 2 hosts of 2 ranks, the one link out of a host carries 1.5x what the
 * host must send. Here the ranks with the same local index on the H hosts form a ring of
 * their own (the cross group), all L such rings at once, so that every rank's link is
 * busy and each carries only its share; the host's ranks (the host group) do the rest
 * over shared memory. Each collective is a two-stage pipeline (pipeline.c) over chunks of
 * its buffer, so that while one chunk crosses between hosts another is worked on in the
 * host:
 *  - allreduce: reduce-scatter chunk c in the host (local index i ends with its host's sum
 *    of block i), allreduce block i across hosts, allgather chunk c in the host; out of a
 *    host 2(H-1)/H of the buffer, the link bound. Every element is reduced in exactly one
 *    place and copied from there, so every rank ends with the same bits.
 *  - allgather: gather the blocks of local index i across hosts, then gather each host's
 *    blocks in the host; out of a host (H-1)/H of the result, the link bound.
 *  - reducescatter: reduce-scatter each host's blocks in the host (local index i ends with
 *    its host's sum of the blocks of local index i on every host), then reduce-scatter
 *    those across hosts; out of a host (H-1)/H of the input, the link bound. */
#include <stdlib.h>
#include <string.h>

#include "hierarchical.h"
#include "pipeline.h"
#include "util.h"

#define CHUNK_BYTES ((size_t)1 << 20)
#define MAX_CHUNKS 64
/* Allgather and reducescatter take chunks of this many times CHUNK_BYTES of the whole:
 * each chunk's end leaves the cross-host link briefly idle, and measured at 16 and 64 MiB
 * across 2 x 2 namespace hosts, 4 MiB chunks reached 0.90 of the link bound where 1 MiB
 * chunks reached 0.67-0.88. */
#define GATHER_CHUNK_FACTOR 4

static int mod(int a, int n) { return ((a % n) + n) % n; }

static rs_group_t local_group(const rs_topology_t *t) {
    return (rs_group_t){t->local_ranks, t->local_size, t->local_index};
}

static rs_group_t cross_group(const rs_topology_t *t) {
    return (rs_group_t){t->cross_ranks, t->hosts, t->cross_index};
}

int rs_hierarchical_chosen(const rs_comm_t *comm, size_t bytes) {
    if (!comm->topology.hierarchical || comm->hierarchical_mode == RS_HIERARCHICAL_OFF)
        return 0;
    return comm->hierarchical_mode == RS_HIERARCHICAL_ON || bytes >= comm->hierarchical_min_bytes;
}

static int chunks_for(size_t bytes, size_t smallest) {
    size_t chunks = bytes / CHUNK_BYTES;
    chunks = chunks < 1 ? 1 : chunks > MAX_CHUNKS ? MAX_CHUNKS : chunks;
    return (int)(smallest && chunks > smallest ? smallest : chunks);
}

/* ---- allreduce ---- */

typedef struct {
    const rs_topology_t *t;
    char *buf;
    size_t count;
    int chunks;
} allreduce_t;

/* The host stage's order RS(0), RS(1), AG(0), RS(2), AG(1), ..., AG(K-1) as (chunk,
 * is_gather): after the first, each chunk's reduce-scatter goes before the previous
 * chunk's allgather, so that the cross stage always has a chunk to take. */
static void host_activity(int i, int chunks, int *chunk, int *gather) {
    if (i == 0 || chunks == 1) {
        *chunk = 0, *gather = i > 0;
        return;
    }
    int last = 2 * chunks - 1;
    *gather = i == last || i % 2 == 0;
    *chunk = i == last ? chunks - 1 : *gather ? i / 2 - 1 : (i + 1) / 2;
}

/* AR(c) (cross) waits for RS(c), the host's activity 2c-1 (0 for c = 0); AG(c) for AR(c). */
static int allreduce_ready(const rs_pipeline_t *p, const rs_stage_t *st, int i) {
    const allreduce_t *a = p->arg;
    if (st == &p->cross)
        return rs_stage_through(&p->host) > (i == 0 ? 0 : 2 * i - 1);
    int c, gather;
    host_activity(i, a->chunks, &c, &gather);
    return !gather || rs_stage_through(&p->cross) > c;
}

static void chunk_span(const allreduce_t *a, size_t elem, int c, char **start,
                       size_t *count) {
    size_t offset;
    rs_even_part(a->count, a->chunks, c, &offset, count);
    *start = a->buf + offset * elem;
}

static rs_status_t allreduce_plan(rs_pipeline_t *p, rs_stage_t *st, int i, int *first,
                                  int *last) {
    const allreduce_t *a = p->arg;
    size_t elem = st->run.elem, count;
    char *start;
    if (st == &p->host) {
        int c, gather, n = a->t->local_size - 1;
        host_activity(i, a->chunks, &c, &gather);
        chunk_span(a, elem, c, &start, &count);
        st->g = local_group(a->t);
        *first = gather ? n : 0;
        *last = gather ? 2 * n : n;
    } else {
        size_t offset;
        chunk_span(a, elem, i, &start, &count);
        rs_even_part(count, a->t->local_size, a->t->local_index, &offset, &count);
        start += offset * elem;
        st->g = cross_group(a->t);
        *first = 0;
        *last = 2 * (a->t->hosts - 1);
    }
    st->run.buf = start;
    return rs_blocks_even(p->comm, count, st->g.n, elem, &st->blocks);
}

static void set_kernel(rs_pipeline_t *p, size_t elem, rs_reduce_fn fn) {
    p->host.run.elem = p->cross.run.elem = elem;
    p->host.run.fn = p->cross.run.fn = fn;
}

rs_status_t rs_hierarchical_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                      rs_reduce_fn fn) {
    const rs_topology_t *t = &comm->topology;
    allreduce_t a = {t, buf, count, chunks_for(count * elem, count)};
    rs_pipeline_t p = {.comm = comm, .arg = &a, .ready = allreduce_ready,
                       .plan = allreduce_plan};
    p.host.count = 2 * a.chunks;
    p.cross.count = a.chunks;
    set_kernel(&p, elem, fn);
    size_t chunk_max = (count + (size_t)a.chunks - 1) / (size_t)a.chunks;
    size_t local_max = (chunk_max + (size_t)t->local_size - 1) / (size_t)t->local_size;
    size_t cross_max = (local_max + (size_t)t->hosts - 1) / (size_t)t->hosts;
    return rs_pipeline_run(&p, local_max * elem, cross_max * elem);
}

/* ---- allgather and reducescatter: one block per rank ---- */

typedef struct {
    const rs_topology_t *t;
    const rs_blocks_t *all; /* every rank's block of the buffer */
    size_t unit;            /* blocks are cut at multiples of this */
    int chunks;
    int gather;             /* allgather's ring steps, else reduce-scatter's */
    const char *src;        /* reduce-scatter: where the input is, if not in the buffer */
} blockwise_t;

/* Chunk c of the blocks of n ranks ranks[0], ranks[stride], ...: position k's block is
 * that part of rank ranks[k * stride]'s block. */
static rs_status_t chunk_blocks(rs_comm_t *comm, const blockwise_t *w, const int *ranks,
                                int stride, int n, int c, rs_blocks_t *out) {
    out->bytes = malloc(2 * (size_t)n * sizeof(size_t));
    if (!out->bytes)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    out->offset = out->bytes + n;
    for (int k = 0; k < n; k++) {
        int r = ranks[k * stride];
        size_t offset, units;
        rs_even_part(w->all->bytes[r] / w->unit, w->chunks, c, &offset, &units);
        out->offset[k] = w->all->offset[r] + offset * w->unit;
        out->bytes[k] = units * w->unit;
    }
    return RS_OK;
}

/* Allgather: the cross stage gathers chunk c of my local index's blocks from every host
 * (needing nothing but my own block); the host stage then gathers chunk c of each host's
 * blocks in the host: my own host's first (they need nothing from the cross stage), then
 * the others, once the cross stage has brought them. */
static int allgather_ready(const rs_pipeline_t *p, const rs_stage_t *st, int i) {
    const blockwise_t *w = p->arg;
    int hosts = w->t->hosts;
    return st == &p->cross || i % hosts == 0 || rs_stage_through(&p->cross) > i / hosts;
}

/* Reducescatter: the host stage reduce-scatters chunk c of every host's blocks in the
 * host; the cross stage, once the host is through chunk c of all of them, reduce-scatters
 * chunk c of my local index's blocks across hosts. */
static int reducescatter_ready(const rs_pipeline_t *p, const rs_stage_t *st, int i) {
    const blockwise_t *w = p->arg;
    return st == &p->host || rs_stage_through(&p->host) >= (i + 1) * w->t->hosts;
}

/* The host activity i = c * H + k works on chunk c of one host's blocks (host k, or for
 * the allgather the k-th before mine, as the cross ring brings them); the cross activity
 * c on chunk c of the blocks of my local index on every host. */
static rs_status_t blockwise_plan(rs_pipeline_t *p, rs_stage_t *st, int i, int *first,
                                  int *last) {
    const blockwise_t *w = p->arg;
    const rs_topology_t *t = w->t;
    int hosts = t->hosts, n = st == &p->host ? t->local_size : hosts;
    *first = w->gather ? n - 1 : 0;
    *last = w->gather ? 2 * (n - 1) : n - 1;
    if (st == &p->cross) {
        st->g = cross_group(t);
        return chunk_blocks(p->comm, w, t->host_ranks + t->local_index, t->local_size, hosts,
                            i, &st->blocks);
    }
    int h = w->gather ? mod(t->cross_index - i % hosts, hosts) : i % hosts;
    st->g = local_group(t);
    RS_CHECK(chunk_blocks(p->comm, w, t->host_ranks + h * t->local_size, 1, t->local_size,
                          i / hosts, &st->blocks));
    for (int k = 0; w->src && k < t->local_size; k++) /* the input this activity reduces */
        memcpy(st->run.buf + st->blocks.offset[k], w->src + st->blocks.offset[k],
               st->blocks.bytes[k]);
    return RS_OK;
}

/* fn NULL: allgather; else reduce-scatter with it (from src, if not NULL). */
static rs_status_t run_blockwise(rs_comm_t *comm, const char *src, char *buf,
                                 const rs_blocks_t *all, size_t unit, rs_reduce_fn fn) {
    const rs_topology_t *t = &comm->topology;
    size_t total = 0;
    for (int r = 0; r < comm->size; r++)
        total += all->bytes[r];
    blockwise_t w = {t, all, unit, chunks_for(total / GATHER_CHUNK_FACTOR, 0), fn == NULL, src};
    rs_pipeline_t p = {.comm = comm, .arg = &w, .plan = blockwise_plan,
                       .ready = w.gather ? allgather_ready : reducescatter_ready};
    p.host.count = w.chunks * t->hosts;
    p.cross.count = w.chunks;
    p.host.run.buf = p.cross.run.buf = buf;
    set_kernel(&p, unit, fn);
    /* what a reduce-scatter step receives: a chunk of the largest block, in whole units */
    size_t most = rs_largest_block(all, comm->size) / unit;
    size_t scratch = w.gather ? 0 : (most + (size_t)w.chunks - 1) / (size_t)w.chunks * unit;
    return rs_pipeline_run(&p, scratch, scratch);
}

rs_status_t rs_hierarchical_allgatherv(rs_comm_t *comm, char *buf, const rs_blocks_t *all,
                                       size_t unit) {
    return run_blockwise(comm, NULL, buf, all, unit, NULL);
}

rs_status_t rs_hierarchical_reduce_scatter(rs_comm_t *comm, const char *src, char *buf,
                                           const rs_blocks_t *all, size_t elem,
                                           rs_reduce_fn fn) {
    return run_blockwise(comm, src, buf, all, elem, fn);
}
