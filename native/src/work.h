/* One submitted request (rs_work_t), as it passes from the calling threads (submit.c)
 * through negotiation (negotiate.c) and execution (execute.c) back to its caller: the
 * type only, so that each of those layers may include it (it belongs to no file). */
#ifndef RINGSYNC_WORK_H
#define RINGSYNC_WORK_H

#include <stdint.h>

#include "checked.h"

/* A request's status while it is ready but not yet run (rs_work_t.status): the engine
 * marks every ready request so before running the round, and running it (or the failure
 * that stopped the round) replaces it. Never returned: callers read a status only once
 * the request is done. No public status code: ringsync.h's are 0..5. */
#define RS_PENDING ((rs_status_t)-1)

/* One submitted tensor; owned by the engine from submit until release. */
typedef struct rs_work {
    int64_t handle;
    char *name;
    rs_meta_t meta;
    const void *sendbuf;
    void *recvbuf;
    int64_t *splits; /* alltoall rows per destination (copied) */
    int start_now;
    double submitted_at;
    /* set by the engine thread; read under the engine mutex once done */
    int done;
    rs_status_t status;
    char *error;
    void *result; /* allgather / alltoall output, until taken */
    int64_t result_rows;
    int64_t *result_splits;
    int synthetic; /* made by the engine for a joined rank: zeros in, result discarded */
    int refusal;   /* stands for a call this rank refused: no handle, freed once negotiated */
    uint64_t blocking_seq; /* this rank's count of blocking calls, this one's; 0: not one */
    uint64_t flight_seq;   /* its flight record (0: none) */
    struct rs_work *next; /* submission queue */
} rs_work_t;

#endif
