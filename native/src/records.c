/* The flight recorder and the straggler events: fixed-size rings, overwritten oldest
 * first, so that keeping them always costs a lock and a copy of a few dozen bytes per
 * collective and never grows. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "records.h"

int rs_flight_init(rs_flight_t *f, int capacity) {
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    f->next_seq = 1;
    if (capacity <= 0)
        return 0;
    f->ring = calloc((size_t)capacity, sizeof *f->ring);
    if (!f->ring)
        return -1;
    f->capacity = capacity;
    return 0;
}

void rs_flight_free(rs_flight_t *f) {
    free(f->ring);
    f->ring = NULL;
    pthread_mutex_destroy(&f->mu);
}

uint64_t rs_flight_begin(rs_flight_t *f, const char *name, const rs_meta_t *meta, int route,
                         double now) {
    if (!f->capacity)
        return 0;
    pthread_mutex_lock(&f->mu);
    uint64_t seq = f->next_seq++;
    rs_flight_record_t *r = &f->ring[seq % (uint64_t)f->capacity];
    r->seq = seq;
    /* (a long name is cut alike on every rank: the records still compare) */
    size_t n = strnlen(name, sizeof r->name - 1);
    memcpy(r->name, name, n);
    r->name[n] = '\0';
    r->kind = meta->kind;
    r->dtype = meta->dtype;
    r->op = meta->op;
    r->root = meta->root;
    r->ndim = meta->ndim < RS_MAX_DIMS ? meta->ndim : RS_MAX_DIMS;
    memcpy(r->shape, meta->shape, sizeof r->shape);
    r->route = route;
    r->status = RS_FLIGHT_RUNNING;
    r->start = now;
    r->end = 0;
    pthread_mutex_unlock(&f->mu);
    return seq;
}

void rs_flight_end(rs_flight_t *f, uint64_t seq, int status, double now) {
    if (!f->capacity || !seq)
        return;
    pthread_mutex_lock(&f->mu);
    rs_flight_record_t *r = &f->ring[seq % (uint64_t)f->capacity];
    if (r->seq == seq) {
        r->status = status;
        r->end = now;
    }
    pthread_mutex_unlock(&f->mu);
}

int rs_flight_copy(rs_flight_t *f, rs_flight_record_t *out, int max) {
    int n = 0;
    if (!f->capacity)
        return 0;
    pthread_mutex_lock(&f->mu);
    uint64_t kept = f->next_seq - 1 < (uint64_t)f->capacity ? f->next_seq - 1
                                                            : (uint64_t)f->capacity;
    for (uint64_t seq = f->next_seq - kept; seq < f->next_seq && n < max; seq++) {
        const rs_flight_record_t *r = &f->ring[seq % (uint64_t)f->capacity];
        if (r->status != RS_FLIGHT_HANDED_OVER)
            out[n++] = *r;
    }
    pthread_mutex_unlock(&f->mu);
    return n;
}

int rs_stragglers_init(rs_stragglers_t *s, int capacity) {
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    if (capacity <= 0)
        return 0;
    s->ring = calloc((size_t)capacity, sizeof *s->ring);
    if (!s->ring)
        return -1;
    s->capacity = capacity;
    return 0;
}

void rs_stragglers_free(rs_stragglers_t *s) {
    free(s->ring);
    s->ring = NULL;
    pthread_mutex_destroy(&s->mu);
}

void rs_stragglers_round(rs_stragglers_t *s, const double *waits, int size) {
    pthread_mutex_lock(&s->mu);
    s->rounds++;
    for (int r = 0; s->capacity && r < size; r++) {
        if (waits[r] <= 0)
            continue;
        rs_wait_event_t *e = &s->ring[s->next++ % (uint64_t)s->capacity];
        *e = (rs_wait_event_t){.round = s->rounds, .rank = r, .wait_seconds = waits[r]};
    }
    pthread_mutex_unlock(&s->mu);
}

int rs_stragglers_copy(rs_stragglers_t *s, rs_wait_event_t *out, int max, uint64_t *now_round) {
    int n = 0;
    pthread_mutex_lock(&s->mu);
    *now_round = s->rounds;
    uint64_t kept = !s->capacity ? 0 : s->next < (uint64_t)s->capacity ? s->next : (uint64_t)s->capacity;
    for (uint64_t i = s->next - kept; i < s->next && n < max; i++)
        out[n++] = s->ring[i % (uint64_t)s->capacity];
    pthread_mutex_unlock(&s->mu);
    return n;
}
