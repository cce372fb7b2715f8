/* Hierarchical allreduce: topology-aware, for communicators spanning several hosts.
 *
 * A flat ring over all ranks crosses each host boundary with one rank's whole share of
 * the traffic: on 2 hosts of 2 ranks, the one link out of a host carries 1.5x the buffer.
 * Here the L ranks of each host first reduce-scatter the buffer among themselves (over
 * shared memory), so that local index i holds its host's sum of block i; then the ranks
 * of local index i on the H hosts allreduce that block in a ring of their own, all L such
 * rings at once, so that every rank's link is busy, each carrying 2(H-1)/H of a block
 * of S/L bytes (the link bound 2(H-1)/H * S per host); then each host allgathers the
 * reduced blocks. Every element is reduced in exactly one place and copied from there,
 * so every rank ends with the same bits. */
#include <stdlib.h>

#include "hierarchical.h"
#include "ring.h"
#include "util.h"

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

/* The three phases run as a pipeline over chunks of the buffer: while chunk c crosses
 * between hosts, chunk c+1 is reduce-scattered (and chunk c-1 allgathered) inside the host,
 * so that the links between hosts never wait for the shared-memory phases. Two stages
 * run at once, each one ring step at a time: the host stage (its ranks' shared-memory
 * rings, in the order RS(0), RS(1), AG(0), RS(2), AG(1), ..., AG(K-1), the same on every
 * rank so that each stream carries one step after another) and the cross stage (AR(0),
 * ..., AR(K-1) with the other hosts' ranks). AR(c) waits for RS(c); AG(c) for AR(c). The
 * two never share a connection: host peers and cross peers are different ranks. */
#define CHUNK_BYTES ((size_t)1 << 20)
#define MAX_CHUNKS 64

typedef struct {
    rs_group_t g;
    rs_blocks_t blocks;   /* this activity's blocks (owned) */
    rs_ring_run_t run;
    rs_ring_arrival_t arrival;
    rs_xfer_t x[2];       /* the current step's transfers */
    int step, last;       /* the current step, one past the last */
    int active;
} stage_t;

typedef struct {
    rs_comm_t *comm;
    char *buf;
    size_t count, elem;
    rs_reduce_fn fn;
    int chunks;
    int host_next;  /* the next host activity: its place in the host order */
    int cross_next; /* the next chunk to allreduce across hosts */
    int reduced;    /* chunks reduce-scattered in the host */
    stage_t host, cross;
} pipeline_t;

/* The host order RS(0), RS(1), AG(0), RS(2), AG(1), ..., AG(K-1) as (chunk, is_gather). */
static void host_activity(int i, int chunks, int *chunk, int *gather) {
    if (i == 0 || chunks == 1) {
        *chunk = 0, *gather = i > 0;
        return;
    }
    int last = 2 * chunks - 1;
    *gather = i == last || i % 2 == 0;
    *chunk = i == last ? chunks - 1 : *gather ? i / 2 - 1 : (i + 1) / 2;
}

static void chunk_span(const pipeline_t *p, int c, char **start, size_t *count) {
    size_t offset;
    rs_even_part(p->count, p->chunks, c, &offset, count);
    *start = p->buf + offset * p->elem;
}

static void set_step(stage_t *st) {
    rs_ring_step(&st->run, st->step, st->x, &st->arrival);
}

/* Start a ring over `g` on `count` elements at `start`, steps first..last-1. */
static rs_status_t start_stage(pipeline_t *p, stage_t *st, rs_group_t g, char *start,
                               size_t count, int first, int last) {
    st->g = g;
    RS_CHECK(rs_blocks_even(p->comm, count, g.n, p->elem, &st->blocks));
    st->run.g = &st->g;
    st->run.blocks = &st->blocks;
    st->run.buf = start;
    st->run.elem = p->elem;
    st->run.fn = p->fn;
    st->step = first;
    st->last = last;
    st->active = 1;
    set_step(st);
    return RS_OK;
}

static rs_status_t start_host(pipeline_t *p, const rs_topology_t *t) {
    int c, gather;
    host_activity(p->host_next, p->chunks, &c, &gather);
    if (gather && p->cross_next <= c)
        return RS_OK; /* AG(c) waits for AR(c) */
    char *start;
    size_t count;
    chunk_span(p, c, &start, &count);
    int n = t->local_size - 1;
    return start_stage(p, &p->host, local_group(t), start, count, gather ? n : 0,
                       gather ? 2 * n : n);
}

static rs_status_t start_cross(pipeline_t *p, const rs_topology_t *t) {
    char *start;
    size_t count, offset, mine;
    chunk_span(p, p->cross_next, &start, &count);
    rs_even_part(count, t->local_size, t->local_index, &offset, &mine);
    return start_stage(p, &p->cross, cross_group(t), start + offset * p->elem, mine, 0,
                       2 * (t->hosts - 1));
}

/* After a step's transfers are done: the next step, or the stage's next activity. */
static void advance(pipeline_t *p, stage_t *st) {
    if (++st->step < st->last) {
        set_step(st);
        return;
    }
    st->active = 0;
    free(st->blocks.bytes);
    st->blocks.bytes = NULL;
    if (st == &p->cross) {
        p->cross_next++;
    } else {
        int c, gather;
        host_activity(p->host_next++, p->chunks, &c, &gather);
        p->reduced += !gather;
    }
}

/* Run both stages' current steps until one of them is done. */
static rs_status_t progress_stages(pipeline_t *p) {
    stage_t *on[2];
    int n = 0;
    if (p->host.active)
        on[n++] = &p->host;
    if (p->cross.active)
        on[n++] = &p->cross;
    if (n == 0)
        return rs_fail(p->comm, RS_ERR_USAGE, "hierarchical allreduce: pipeline stalled "
                       "(a bug: chunk %d of %d)", p->cross_next, p->chunks);
    rs_xfer_t x[4];
    for (int i = 0; i < n; i++)
        x[2 * i] = on[i]->x[0], x[2 * i + 1] = on[i]->x[1];
    rs_status_t st = rs_progress_any_pair(p->comm, x, 2 * n);
    for (int i = 0; i < n; i++) {
        on[i]->x[0] = x[2 * i], on[i]->x[1] = x[2 * i + 1];
        if (st == RS_OK && on[i]->x[0].done >= on[i]->x[0].len &&
            on[i]->x[1].done >= on[i]->x[1].len)
            advance(p, on[i]);
    }
    return st;
}

static rs_status_t run_pipeline(pipeline_t *p, const rs_topology_t *t) {
    while (p->host_next < 2 * p->chunks || p->cross_next < p->chunks) {
        if (!p->host.active && p->host_next < 2 * p->chunks)
            RS_CHECK(start_host(p, t));
        if (!p->cross.active && p->cross_next < p->chunks && p->reduced > p->cross_next)
            RS_CHECK(start_cross(p, t));
        RS_CHECK(progress_stages(p));
    }
    return RS_OK;
}

static int chunks_for(size_t count, size_t elem) {
    size_t chunks = count * elem / CHUNK_BYTES;
    chunks = chunks < 1 ? 1 : chunks > MAX_CHUNKS ? MAX_CHUNKS : chunks;
    return (int)(chunks > count ? (count ? count : 1) : chunks);
}

rs_status_t rs_hierarchical_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                      rs_reduce_fn fn) {
    const rs_topology_t *t = &comm->topology;
    pipeline_t p = {.comm = comm, .buf = buf, .count = count, .elem = elem, .fn = fn,
                    .chunks = chunks_for(count, elem)};
    size_t chunk_max = (count + (size_t)p.chunks - 1) / (size_t)p.chunks;
    size_t local_max = (chunk_max + (size_t)t->local_size - 1) / (size_t)t->local_size;
    size_t cross_max = (local_max + (size_t)t->hosts - 1) / (size_t)t->hosts;
    p.host.run.incoming = malloc(local_max * elem + 1);
    p.cross.run.incoming = malloc(cross_max * elem + 1);
    rs_status_t st = p.host.run.incoming && p.cross.run.incoming
                         ? run_pipeline(&p, t)
                         : rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    free(p.host.blocks.bytes);
    free(p.cross.blocks.bytes);
    free(p.host.run.incoming);
    free(p.cross.run.incoming);
    return st;
}
