/* Bounded records of what an engine did (records.c), kept always and read on demand:
 * the flight recorder (the last collectives this rank issued, with their outcome) and
 * the straggler events (which rank the others waited for, and how long). Both are
 * written by the engine thread and by calling threads, and read by any thread: each has
 * its own lock, held for a copy only. */
#ifndef RINGSYNC_RECORDS_H
#define RINGSYNC_RECORDS_H

#include <pthread.h>
#include <stdint.h>

#include "checked.h"
#include "ringsync.h"

typedef struct {
    pthread_mutex_t mu;
    rs_flight_record_t *ring; /* capacity entries; entry seq % capacity */
    int capacity;
    uint64_t next_seq; /* the next record's seq (seqs start at 1) */
} rs_flight_t;

/* capacity 0: record nothing. -1 when out of memory. */
int rs_flight_init(rs_flight_t *f, int capacity);
void rs_flight_free(rs_flight_t *f);
/* A collective starts: returns its seq (0 when nothing is recorded). */
uint64_t rs_flight_begin(rs_flight_t *f, const char *name, const rs_meta_t *meta, int route,
                         double now);
/* It ended with status st (RS_FLIGHT_HANDED_OVER: the lane gave it to the engine, which
 * records it itself). A seq already overwritten is ignored. */
void rs_flight_end(rs_flight_t *f, uint64_t seq, int status, double now);
/* Oldest first, at most max; returns how many. */
int rs_flight_copy(rs_flight_t *f, rs_flight_record_t *out, int max);

typedef struct {
    pthread_mutex_t mu;
    rs_wait_event_t *ring;
    int capacity;
    uint64_t next;   /* events written */
    uint64_t rounds; /* negotiation rounds that ran collectives */
} rs_stragglers_t;

int rs_stragglers_init(rs_stragglers_t *s, int capacity);
void rs_stragglers_free(rs_stragglers_t *s);
/* A round that ran collectives; `waits[r]` is how long the others waited for rank r in
 * it (0: not last). Records an event per rank with a wait. */
void rs_stragglers_round(rs_stragglers_t *s, const double *waits, int size);
/* The events of the last `rounds` rounds (oldest first, at most max); *now_round: the
 * rounds counted so far. */
int rs_stragglers_copy(rs_stragglers_t *s, rs_wait_event_t *out, int max, uint64_t *now_round);

#endif
