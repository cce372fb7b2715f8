/* The timeline (timeline.c): a Chrome-trace JSON file of the phases of each tensor's
 * life, written by the engine thread and by callers on the same-host lane. */
#ifndef RINGSYNC_TIMELINE_H
#define RINGSYNC_TIMELINE_H

#include <pthread.h>
#include <stdio.h>

#include "ringsync.h"
#include "util.h"

typedef struct {
    pthread_mutex_t mu;
    FILE *file;
    int rank;
    int events;
    rs_map_t tids; /* tensor name -> track id */
    int next_tid;
    int mark_cycles; /* an instant event at the start of each negotiation round */
} rs_timeline_t;

void rs_timeline_init(rs_timeline_t *t, int rank);
rs_status_t rs_timeline_start(rs_timeline_t *t, const char *path, int mark_cycles);
void rs_timeline_stop(rs_timeline_t *t);
/* The phases of a tensor's life, named as Horovod's timeline names them (see timeline.c). */
typedef enum {
    RS_SPAN_NEGOTIATE, /* NEGOTIATE_<KIND>: from submission until every rank has it */
    RS_SPAN_RUN,       /* <KIND>: the collective itself */
    RS_SPAN_LANE,      /* <KIND> too, on the same-host lane (no negotiation) */
    RS_SPAN_COPY_IN,   /* MEMCPY_IN_FUSION_BUFFER */
    RS_SPAN_COPY_OUT,  /* MEMCPY_OUT_FUSION_BUFFER */
    RS_SPAN_SEND,
    RS_SPAN_RECV
} rs_span_t;

/* One span of the life of tensor `name`, a collective of `kind`. */
void rs_timeline_span(rs_timeline_t *t, int kind, const char *name, rs_span_t phase,
                      double start, double end);
/* A counter track `name` with one series per rank ("rank 3"), set to value at `now`. */
void rs_timeline_counter(rs_timeline_t *t, const char *name, int series_rank, double value,
                         double now);
/* CYCLE_START, an instant event on this rank's process, where mark_cycles is on. */
void rs_timeline_cycle(rs_timeline_t *t, double now);

#endif
