/* A two-stage pipeline of ring runs: the host stage runs rings among this host's ranks
 * (over shared memory), the cross stage rings among the ranks with this rank's local index
 * on every host (over the network), both at once, so that the links between hosts need not
 * wait for the shared-memory phases. Each stage runs its activities in order, each a ring
 * run taken as two streams of steps (rs_ring_stream_t); an activity starts once the
 * collective's `ready` says its input is there. Every rank of a host runs the same
 * activities in the same order, so each connection carries one step after another; the
 * two stages never share a connection (host peers and cross peers are different ranks). */
#include <stdlib.h>

#include "pipeline.h"

int rs_stage_through(const rs_stage_t *st) { return st->next - st->active; }

static rs_status_t start_activity(rs_pipeline_t *p, rs_stage_t *st, rs_xfer_t x[2]) {
    int first, last;
    st->run.g = &st->g;
    st->run.blocks = &st->blocks;
    RS_CHECK(p->plan(p, st, st->next, &first, &last));
    st->next++;
    st->active = 1;
    rs_ring_stream_start(&st->stream, &st->run, x, first, last);
    return RS_OK;
}

static void finish_activity(rs_stage_t *st) {
    st->active = 0;
    free(st->blocks.bytes);
    st->blocks.bytes = NULL;
}

/* Start what may start; returns how many activities finished (0: progress is needed). */
static rs_status_t step_stages(rs_pipeline_t *p, int *finished) {
    rs_stage_t *stages[2] = {&p->host, &p->cross};
    *finished = 0;
    for (int i = 0; i < 2; i++) {
        rs_stage_t *st = stages[i];
        if (!st->active && st->next < st->count && p->ready(p, st, st->next))
            RS_CHECK(start_activity(p, st, &p->x[2 * i]));
        if (st->active && rs_ring_stream_advance(&st->stream)) {
            finish_activity(st);
            (*finished)++;
        }
    }
    return RS_OK;
}

static int all_through(const rs_pipeline_t *p) {
    return rs_stage_through(&p->host) == p->host.count &&
           rs_stage_through(&p->cross) == p->cross.count;
}

static rs_status_t run_stages(rs_pipeline_t *p) {
    while (!all_through(p)) {
        int finished;
        RS_CHECK(step_stages(p, &finished));
        if (finished)
            continue;
        if (!p->host.active && !p->cross.active)
            return rs_fail(p->comm, RS_ERR_USAGE, "rank %d: hierarchical pipeline stalled "
                           "(a bug: host %d/%d, cross %d/%d)", p->comm->rank, p->host.next,
                           p->host.count, p->cross.next, p->cross.count);
        RS_CHECK(rs_progress_any(p->comm, p->x, 4));
    }
    return RS_OK;
}

rs_status_t rs_pipeline_run(rs_pipeline_t *p, size_t host_scratch, size_t cross_scratch) {
    for (int i = 0; i < 4; i++)
        p->x[i] = (rs_xfer_t){.peer = -1}; /* nothing moves until a stage starts */
    p->host.next = p->host.active = p->cross.next = p->cross.active = 0;
    p->host.blocks.bytes = p->cross.blocks.bytes = NULL;
    p->host.run.incoming = malloc(host_scratch + 1);
    p->cross.run.incoming = malloc(cross_scratch + 1);
    rs_status_t st = p->host.run.incoming && p->cross.run.incoming
                         ? run_stages(p)
                         : rs_fail(p->comm, RS_ERR_NOMEM, "out of memory");
    free(p->host.blocks.bytes);
    free(p->cross.blocks.bytes);
    free(p->host.run.incoming);
    free(p->cross.run.incoming);
    return st;
}
