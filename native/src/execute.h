/* Running the tensors negotiation made ready (execute.c): fusion, the collectives, the
 * messages, and the settings a tune request changes. The engine thread's alone. */
#ifndef RINGSYNC_EXECUTE_H
#define RINGSYNC_EXECUTE_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "lane.h"
#include "negotiate.h"
#include "timeline.h"

typedef struct {
    rs_comm_t *comm;
    int64_t fusion_threshold;
    void *fusion;
    size_t fusion_bytes;
    rs_timeline_t *timeline;
    rs_lane_t *staged;        /* same-host staged allreduce, or NULL */
    size_t staged_min_bytes;  /* allreduces at least this large use it */
    double cycle_time_ms;     /* gather_more's longest wait */
    /* What a tune request set last (RS_TUNE_*): written by the engine thread, read
     * atomically by callers of rs_engine_settings. */
    int64_t settings[RS_TUNE_COUNT];
} rs_executor_t;

/* Run the ready tensors in order, fusing neighbouring allreduces. Each rs_work_t gets its
 * status; a communication failure is returned (every later tensor fails with it). */
rs_status_t rs_execute(rs_executor_t *x, rs_pending_t **ready, int nready);

#endif
