/* A two-stage pipeline of ring runs (pipeline.c): what the hierarchical collectives
 * (hierarchical.c) are made of. */
#ifndef RINGSYNC_PIPELINE_H
#define RINGSYNC_PIPELINE_H

#include <stddef.h>

#include "comm.h"
#include "progress.h"
#include "ring.h"

/* One stage: a sequence of activities, each a ring run over a group, one at a time. */
typedef struct {
    int count;  /* activities in all */
    int next;   /* the next to start: those before it are through, or running if active */
    int active;
    rs_group_t g;
    rs_blocks_t blocks; /* the running activity's (owned: the pipeline frees it) */
    rs_ring_run_t run;  /* g and blocks point at the two above */
    rs_ring_stream_t stream;
} rs_stage_t;

typedef struct rs_pipeline rs_pipeline_t;
struct rs_pipeline {
    rs_comm_t *comm;
    rs_stage_t host;  /* rings among this host's ranks (shared memory) */
    rs_stage_t cross; /* rings among the ranks with my local index on every host */
    rs_xfer_t x[4];   /* the host stage's send and receive, then the cross stage's */
    void *arg;        /* the collective's own */
    /* Whether activity i of stage st may start: what it reads is there (the other
     * stage's earlier activities are through far enough). */
    int (*ready)(const rs_pipeline_t *p, const rs_stage_t *st, int i);
    /* Plan activity i of st: fill st->g, st->blocks (allocated last, so that a failure
     * leaves nothing to free), st->run's buf, elem and fn, and its steps [first, last). */
    rs_status_t (*plan)(rs_pipeline_t *p, rs_stage_t *st, int i, int *first, int *last);
};

/* Activities of st that are through. */
int rs_stage_through(const rs_stage_t *st);
/* Run both stages' activities to the end; `host_scratch` and `cross_scratch` are the
 * largest block a reduce-scatter step of that stage receives (0: no reduce-scatter). */
rs_status_t rs_pipeline_run(rs_pipeline_t *p, size_t host_scratch, size_t cross_scratch);

#endif
