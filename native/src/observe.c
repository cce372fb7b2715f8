/* The calling threads' view into an engine (any thread): its flight records, straggler
 * events and hang reports (see "seeing inside a job" in ringsync.h). The records keep
 * their own locks; a hang report's snapshot is the engine thread's, read under mu. */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <time.h>

#include "engine.h"

int rs_engine_flight_records(rs_engine_t *e, rs_flight_record_t *out, int max) {
    return rs_flight_copy(&e->flight, out, max);
}

double rs_monotonic_seconds(void) { return rs_now(); }

int rs_engine_wait_events(rs_engine_t *e, rs_wait_event_t *out, int max, uint64_t *rounds) {
    return rs_stragglers_copy(&e->stragglers, out, max, rounds);
}

static struct timespec deadline_after(double seconds) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until); /* (report_cv's clock) */
    double t = (double)until.tv_sec + until.tv_nsec * 1e-9 + seconds;
    until.tv_sec = (time_t)t;
    until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
    return until;
}

uint64_t rs_engine_wait_report(rs_engine_t *e, uint64_t after, double timeout_seconds,
                               int *reason) {
    struct timespec until = deadline_after(timeout_seconds);
    pthread_mutex_lock(&e->mu);
    /* (closed for good, not for the waits of the moment: a waiter that comes after
     * rs_engine_interrupt_waits must not wait either, or its thread is never joined) */
    while (e->report_id <= after && !e->report_waits_closed &&
           pthread_cond_timedwait(&e->report_cv, &e->mu, &until) != ETIMEDOUT) {
    }
    uint64_t id = e->report_id > after ? e->report_id : 0;
    *reason = e->report_reason;
    pthread_mutex_unlock(&e->mu);
    return id;
}

void rs_engine_interrupt_waits(rs_engine_t *e) {
    pthread_mutex_lock(&e->mu);
    e->report_waits_closed = 1;
    pthread_cond_broadcast(&e->report_cv);
    pthread_mutex_unlock(&e->mu);
}

int rs_engine_report_pending(rs_engine_t *e, rs_pending_info_t *out, unsigned char *submitted,
                             int max, int *total) {
    size_t size = (size_t)e->comm->size;
    pthread_mutex_lock(&e->mu);
    int n = e->report_count < max ? e->report_count : max;
    if (n > 0) {
        memcpy(out, e->report_items, (size_t)n * sizeof *out);
        memcpy(submitted, e->report_submitted, (size_t)n * size);
    }
    *total = e->report_count;
    pthread_mutex_unlock(&e->mu);
    return n < 0 ? 0 : n;
}
