/* The same-host lane's glue: a blocking collective runs on the calling thread through
 * direct.c, checked like a submission and failing like the engine. Above engine.c, it
 * uses what the engine lends it (engine.h); the engine knows nothing of it (a joined
 * rank's wait serves the lane through direct.c, below the engine).
 *
 * Errors: the lane's record is read under the lane's lock, right after the call that
 * wrote it; a broken connection or a timeout then fails the engine (which tells the
 * peers), and every failure ends in the engine's error record for the caller to read. */
#include "engine.h"

int rs_engine_has_lane(rs_engine_t *e) { return rs_engine_lane(e) != NULL; }

static size_t element_count(const rs_meta_t *meta) {
    size_t count = meta->kind == RS_KIND_BARRIER ? 0 : 1;
    for (int d = 0; d < meta->ndim; d++)
        count *= (size_t)meta->shape[d];
    return count;
}

/* A lane call failed with st; why: the lane's record (code RS_OK: nothing of its own). */
static rs_status_t report(rs_engine_t *e, rs_status_t st, const rs_error_t *why) {
    if (st == RS_ERR_COMM || st == RS_ERR_TIMEOUT || st == RS_ERR_SYSTEM) {
        if (why->code != RS_OK)
            rs_engine_fail(e, st, why->text); /* else the engine had failed: it has the words */
        return rs_engine_report_failure(e, st);
    }
    if (why->code != RS_OK)
        return rs_engine_report(e, st, why->text);
    rs_error_t comm_why; /* a reduction failed: the communicator's record says why */
    rs_comm_error(rs_engine_comm(e), &comm_why);
    return rs_engine_report(e, st, comm_why.text);
}

/* This rank's check of a blocking call failed with st (the engine's record says why):
 * post the refusal in the call's place, so that the peers fail the same call, and wait
 * for them. Returns st with the reason still in the record (or the failure that ended
 * the wait). */
static rs_status_t refuse_on_lane(rs_engine_t *e, rs_direct_t *lane, const char *name,
                                  int kind, rs_status_t st) {
    if (st != RS_ERR_USAGE)
        return st; /* the engine has failed: no call is matched any more */
    char reason[RS_ERROR_LEN];
    snprintf(reason, sizeof reason, "%s", rs_engine_last_error(e));
    rs_error_t why;
    rs_direct_lock(lane);
    rs_status_t waited = rs_direct_refuse(lane, name, kind, reason, rs_engine_failure(e),
                                          rs_engine_joins(e));
    if (waited != RS_OK)
        rs_error_copy(&why, rs_direct_error(lane));
    rs_direct_unlock(lane);
    return waited != RS_OK ? report(e, waited, &why) : rs_engine_report(e, st, reason);
}

rs_status_t rs_engine_refuse(rs_engine_t *e, const char *name, int kind, const char *reason,
                             int blocking) {
    rs_direct_t *lane = rs_engine_lane(e);
    if (!blocking || !lane) {
        rs_engine_refuse_later(e, name, kind, blocking);
        return RS_OK;
    }
    rs_engine_report(e, RS_ERR_USAGE, reason ? reason : "");
    rs_status_t st = refuse_on_lane(e, lane, name ? name : "", kind, RS_ERR_USAGE);
    return st == RS_ERR_USAGE ? RS_OK : st;
}

/* A blocking call on the same-host lane (see direct.c). */
rs_status_t rs_engine_try_lane(rs_engine_t *e, const char *name, const rs_request_t *r,
                               int *ran) {
    rs_direct_t *lane = rs_engine_lane(e);
    *ran = 0;
    if (!lane || r->kind == RS_KIND_JOIN || r->kind == RS_KIND_SEND || r->kind == RS_KIND_RECV ||
        r->kind == RS_KIND_TUNE) /* (settings change on the engine thread, in agreed order) */
        return RS_OK;
    rs_status_t st = rs_engine_validate(e, name, r);
    if (st != RS_OK) {
        *ran = 1;
        return refuse_on_lane(e, lane, name, r->kind, st);
    }
    rs_meta_t meta = rs_request_meta(r);
    rs_error_t why; /* read only after a failure */
    double start = rs_now();
    rs_direct_lock(lane);
    st = rs_direct_run(lane, name, &meta, element_count(&meta), r->sendbuf, r->recvbuf,
                       rs_engine_failure(e), rs_engine_joins(e), ran);
    if (st != RS_OK)
        rs_error_copy(&why, rs_direct_error(lane)); /* before another thread's call */
    rs_direct_unlock(lane);
    rs_timeline_t *timeline = rs_engine_timeline(e);
    if (*ran && timeline->file)
        rs_timeline_span(timeline, r->kind, name, RS_SPAN_LANE, start, rs_now());
    return st == RS_OK ? RS_OK : report(e, st, &why);
}
