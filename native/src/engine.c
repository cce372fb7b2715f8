/* The engine thread: a background thread per communicator. Callers submit requests and
 * get handles at once (submit.c); this thread negotiates with the other ranks, runs what
 * is ready (fused) and completes the handles. It never sleeps a fixed cycle: while idle it
 * blocks in poll on its neighbours (a peer starting a negotiation round) and on a
 * self-pipe (a local submission). Also here: failing the engine, and its lifecycle
 * (create, abort, destroy, the timeline's start and stop). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "progress.h" /* rs_fail_lost_peer */
#include "transport.h"

#define FUSION_IDLE_GAP_SECONDS 100e-6 /* stop gathering once submissions pause this long */
#define STRAGGLER_EVENTS 8192          /* straggler events kept (a few per round at most) */

void rs_work_free(rs_work_t *w) {
    free(w->name);
    free(w->splits);
    free(w->error);
    free(w->result);
    free(w->result_splits);
    free(w);
}

/* ---- completing requests ---- */

/* Under mu. */
static void finish_locked(rs_engine_t *e, rs_work_t *w) {
    if (!w->done && w->meta.kind == RS_KIND_SEND && !w->synthetic)
        e->p2p_in_flight--;
    if (!w->done)
        rs_flight_end(&e->flight, w->flight_seq, w->status, rs_now());
    __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE); /* a joined rank's lane reads it */
    rs_map_remove(&e->in_flight, w->name);
}

/* Under mu: a refusal is done once negotiated (or failed): nobody waits for it. */
static void drop_refusal_locked(rs_engine_t *e, rs_work_t *w) {
    if (rs_map_get(&e->in_flight, w->name) == w)
        rs_map_remove(&e->in_flight, w->name);
    rs_work_free(w);
}

static void fail_locked(rs_engine_t *e, rs_work_t *w) {
    if (w->refusal) {
        drop_refusal_locked(e, w);
        return;
    }
    w->status = e->failure.code;
    free(w->error);
    w->error = strdup(e->failure.text);
    finish_locked(e, w);
}

/* Under mu. The first failure sticks. The text is complete before the code appears to a
 * waiter that reads only the code. */
static void set_failure_locked(rs_engine_t *e, rs_status_t st, const char *text) {
    if (e->failure.code != RS_OK)
        return;
    snprintf(e->failure.text, sizeof e->failure.text, "%s", text);
    __atomic_store_n(&e->failure.code, st, __ATOMIC_RELEASE);
    __atomic_store_n(&e->lane_stop, st, __ATOMIC_RELEASE);
}

/* A broken communicator fails everything: queued, pending (see drop_negotiation) and later
 * submissions. Aborting the communicator tells the peers, so they fail too instead of
 * waiting. Any thread may call it: it touches only what mu guards, and wakes the engine
 * thread, which fails the requests its negotiation holds (the negotiator is the engine
 * thread's alone: freeing it here raced with the thread reading it, a crash seen in
 * elastic recovery when a caller aborted while the thread looked for lost peers). */
void rs_engine_fail(rs_engine_t *e, rs_status_t st, const char *text) {
    pthread_mutex_lock(&e->mu);
    set_failure_locked(e, st, text);
    for (rs_work_t *w = e->queue_head, *next; w; w = next) {
        next = w->next; /* (a refusal is freed) */
        fail_locked(e, w);
    }
    e->queue_head = e->queue_tail = NULL;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
    rs_comm_abort(e->comm);
    rs_engine_wake(e);
}

/* The engine thread, once failed: fail this rank's requests that negotiation still holds
 * and forget the negotiation (its peers' halves will never come). */
static void drop_negotiation(rs_engine_t *e) {
    rs_negotiator_t *n = &e->negotiator;
    if (!n->pending.capacity)
        return;
    pthread_mutex_lock(&e->mu);
    for (size_t i = 0; i < n->pending.capacity; i++) {
        rs_pending_t *p = n->pending.keys[i] ? n->pending.values[i] : NULL;
        if (p && p->mine && p->mine->synthetic)
            rs_work_free(p->mine); /* the engine's own (a joined rank's zeros): no handle */
        else if (p && p->mine && !p->mine->done)
            fail_locked(e, p->mine);
        if (p)
            rs_pending_free(p);
    }
    rs_map_free(&n->pending);
    n->join = NULL;
    n->my_blocking_pending = 0;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

/* The engine thread: fail the engine with the communicator's error. */
static void fail_with_comm_error(rs_engine_t *e, rs_status_t st) {
    rs_error_t why;
    rs_comm_error(e->comm, &why);
    rs_engine_fail(e, st, why.text);
}

static void fail_batch(rs_engine_t *e, rs_work_t **batch, int n) {
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < n; i++)
        if (!batch[i]->done)
            fail_locked(e, batch[i]);
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

/* ---- the engine thread ---- */

static void drain_wake_pipe(rs_engine_t *e) {
    char buf[256];
    while (read(e->wake[0], buf, sizeof buf) > 0) {
    }
}

void rs_engine_wake(rs_engine_t *e) {
    char c = 1;
    if (write(e->wake[1], &c, 1) < 0 && errno != EAGAIN) {
        /* a full pipe already wakes the thread */
    }
}

void rs_engine_request_report(rs_engine_t *e, int reason) {
    pthread_mutex_lock(&e->mu);
    uint64_t known = e->report_wanted > e->report_id ? e->report_wanted : e->report_id;
    e->report_wanted_reason = reason == RS_REPORT_STALL ? RS_REPORT_STALL : RS_REPORT_REQUEST;
    __atomic_store_n(&e->report_wanted, known + 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&e->mu);
    rs_engine_wake(e);
}

/* Move the submission queue into the batch (under mu). */
static int take_queue_locked(rs_engine_t *e, rs_work_t ***batch, int *n, int *cap) {
    for (rs_work_t *w = e->queue_head; w; w = w->next) {
        if (*n == *cap) {
            int grown = *cap ? *cap * 2 : 64;
            rs_work_t **b = realloc(*batch, (size_t)grown * sizeof *b);
            if (!b)
                return -1; /* the rest stays queued for the next round */
            *batch = b;
            *cap = grown;
        }
        (*batch)[(*n)++] = w;
        e->queue_head = w->next;
    }
    if (!e->queue_head)
        e->queue_tail = NULL;
    return 0;
}

static int any_starts_now(rs_work_t **batch, int n) {
    for (int i = 0; i < n; i++)
        if (batch[i]->start_now)
            return 1;
    return 0;
}

/* Asynchronous submissions tend to come in bursts (a backward pass): wait a little for the
 * rest of the burst, at most cycle_time, so that they fuse. A waiting caller (start_now) or a
 * pause in the burst ends the wait at once. */
static void gather_more(rs_engine_t *e, rs_work_t ***batch, int *n, int *cap) {
    double deadline = rs_now() + e->executor.cycle_time_ms * 1e-3;
    int first = 1; /* the burst has only begun: wait one gap before calling it paused */
    for (;;) {
        pthread_mutex_lock(&e->mu);
        int before = *n;
        take_queue_locked(e, batch, n, cap);
        int go_now = any_starts_now(*batch, *n) || e->stopping;
        double left = deadline - rs_now();
        int paused = *n == before && !first;
        int keep_gathering = !go_now && !paused && left > 0;
        e->gathering = keep_gathering; /* (a caller that waits may clear it and wake us) */
        pthread_mutex_unlock(&e->mu);
        if (!keep_gathering)
            return;
        first = 0;
        double wait = left < FUSION_IDLE_GAP_SECONDS ? left : FUSION_IDLE_GAP_SECONDS;
        struct timespec ts = {0, (long)(wait * 1e9)};
        struct pollfd p = {.fd = e->wake[0], .events = POLLIN};
        int woken = ppoll(&p, 1, &ts, NULL) > 0;
        pthread_mutex_lock(&e->mu);
        e->gathering = 0;
        pthread_mutex_unlock(&e->mu);
        if (woken)
            drain_wake_pipe(e); /* someone waits, or stop: the next look returns */
    }
}

/* This rank has joined and did not submit p: take part with zeros (allreduce only; the
 * other kinds fail on every rank, see rs_check_agreement). */
static rs_work_t *stand_in_work(const rs_pending_t *p, int rank) {
    const rs_meta_t *m = &p->metas[rank];
    size_t bytes = rs_dtype_size(m->dtype);
    for (int d = 0; m->kind != RS_KIND_TUNE && d < m->ndim; d++) /* (a tune's are settings) */
        bytes *= (size_t)m->shape[d];
    rs_work_t *w = calloc(1, sizeof *w);
    void *zeros = calloc(1, bytes ? bytes : 1);
    char *name = strdup(p->name);
    if (!w || !zeros || !name) {
        free(w);
        free(zeros);
        free(name);
        return NULL;
    }
    w->name = name;
    w->meta = *m;
    w->sendbuf = w->recvbuf = w->result = zeros; /* freed with the work */
    w->synthetic = 1;
    return w;
}

static void complete_ready(rs_engine_t *e, rs_pending_t **ready, int nready, rs_status_t st) {
    rs_error_t why = {0};
    if (st != RS_OK)
        rs_comm_error(e->comm, &why);
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < nready; i++) {
        rs_work_t *w = ready[i]->mine;
        if (!w)
            continue; /* a round that failed before it got here: rs_engine_fail ends all */
        if (w->synthetic) {
            rs_work_free(w);
            continue;
        }
        if (w->refusal) {
            drop_refusal_locked(e, w);
            continue;
        }
        if (w->meta.kind == RS_KIND_JOIN) {
            w->result_rows = ready[i]->last_rank;
            __atomic_add_fetch(&e->joins, 1, __ATOMIC_RELEASE);
        }
        if (w->status == RS_PENDING) { /* not run: a failure stopped the round */
            w->status = st;
            w->error = strdup(why.text);
        }
        finish_locked(e, w);
    }
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

/* Every ready tensor gets a request: this rank's, or zeros where it has joined. */
static rs_status_t take_part(rs_engine_t *e, rs_pending_t **ready, int nready) {
    double now = rs_now();
    for (int i = 0; i < nready; i++) {
        if (!ready[i]->mine && rs_pending_is_p2p(ready[i]))
            continue; /* a message between two other ranks: they alone move it */
        rs_work_t *w = ready[i]->mine ? ready[i]->mine : stand_in_work(ready[i], e->comm->rank);
        if (!w)
            return rs_fail(e->comm, RS_ERR_COMM, "rank %d: out of memory", e->comm->rank);
        ready[i]->mine = w;
        w->status = RS_PENDING;
        if (e->timeline.file && !w->synthetic && !w->refusal)
            rs_timeline_span(&e->timeline, w->meta.kind, ready[i]->name, RS_SPAN_NEGOTIATE,
                             w->submitted_at, now);
    }
    return RS_OK;
}

/* ---- seeing inside the job ---- */

/* Which ranks the others waited for in this round's collectives, and how long: a
 * straggler event per rank (see rs_wait_event_t), and a counter on the timeline. */
static void note_waits(rs_engine_t *e, rs_pending_t **ready, int nready) {
    int size = e->comm->size, collectives = 0;
    if (!e->stragglers.capacity)
        return;
    for (int r = 0; r < size; r++)
        e->round_waits[r] = 0;
    for (int i = 0; i < nready; i++)
        collectives += rs_pending_waits(ready[i], size, e->round_waits);
    if (!collectives)
        return;
    rs_stragglers_round(&e->stragglers, e->round_waits, size);
    for (int r = 0; e->timeline.file && r < size; r++)
        if (e->round_waits[r] > 0)
            rs_timeline_counter(&e->timeline, "others waited for rank (ms)", r,
                                e->round_waits[r] * 1e3, rs_now());
}

/* Under mu: the blocking call this rank waits in on the same-host lane (no negotiation
 * holds it) as item `at` of the snapshot; returns 1 if there is one. */
static int add_lane_call(rs_engine_t *e, int at, double now) {
    rs_pending_info_t *info = &e->report_items[at];
    unsigned char *posted = e->report_submitted + (size_t)at * (size_t)e->comm->size;
    double since;
    if (!rs_lane_waiting(e->lane, info->name, sizeof info->name, &info->kind, &since, posted))
        return 0;
    info->mine = 1;
    info->waited_seconds = now - since;
    return 1;
}

/* Under mu: the tensors negotiation holds now, for the hang report just agreed on. */
static void take_report_snapshot_locked(rs_engine_t *e) {
    rs_negotiator_t *n = &e->negotiator;
    int size = e->comm->size, count = 0;
    double now = rs_now();
    free(e->report_items);
    free(e->report_submitted);
    e->report_items = calloc(n->pending.count + 1, sizeof *e->report_items);
    e->report_submitted = calloc((n->pending.count + 1) * (size_t)size, 1);
    for (size_t i = 0; e->report_items && e->report_submitted && i < n->pending.capacity; i++) {
        const rs_pending_t *p = n->pending.keys[i] ? n->pending.values[i] : NULL;
        if (!p || (p->mine && p->mine->refusal))
            continue;
        rs_pending_info_t *info = &e->report_items[count];
        snprintf(info->name, sizeof info->name, "%s", p->name);
        info->kind = p->metas[p->last_rank].kind;
        info->mine = p->mine != NULL && !p->mine->synthetic;
        info->waited_seconds = now - p->first_seen;
        memcpy(e->report_submitted + (size_t)count * (size_t)size, p->submitted, (size_t)size);
        count++;
    }
    if (e->report_items && e->report_submitted && e->lane)
        count += add_lane_call(e, count, now);
    e->report_count = count;
    e->report_id = n->report >> 8;
    e->report_reason = (int)(n->report & 0xff);
    pthread_cond_broadcast(&e->report_cv);
}

/* A hang report that the last round agreed on: take this rank's snapshot. */
static void take_report_if_asked(rs_engine_t *e) {
    if (!e->negotiator.report_new)
        return;
    e->negotiator.report_new = 0;
    pthread_mutex_lock(&e->mu);
    take_report_snapshot_locked(e);
    pthread_mutex_unlock(&e->mu);
}

/* A report asked for here that no round has carried yet (the negotiator's ask). */
static int report_to_ask(rs_engine_t *e) {
    /* (a look without the lock first: the engine loop asks every time round) */
    if (__atomic_load_n(&e->report_wanted, __ATOMIC_ACQUIRE) <= e->negotiator.report >> 8)
        return 0;
    pthread_mutex_lock(&e->mu);
    uint64_t wanted = e->report_wanted;
    int reason = e->report_wanted_reason;
    pthread_mutex_unlock(&e->mu);
    e->negotiator.report_ask = wanted << 8 | (uint64_t)reason;
    return 1;
}

/* One negotiation round and the work it makes ready. */
static rs_status_t run_round(rs_engine_t *e, rs_work_t **batch, int nbatch) {
    rs_pending_t **ready = NULL;
    int nready = 0;
    report_to_ask(e);
    RS_CHECK(rs_negotiate(e->comm, &e->negotiator, batch, nbatch, &ready, &nready));
    take_report_if_asked(e);
    note_waits(e, ready, nready);
    rs_status_t st;
    RS_CHECK_GOTO(take_part(e, ready, nready), st, done);
    st = rs_execute(&e->executor, ready, nready);
done:
    for (int i = 0; i < nready; i++)
        if (ready[i]->mine && ready[i]->mine->status == RS_OK)
            rs_negotiator_cache(&e->negotiator, ready[i]);
    complete_ready(e, ready, nready, st);
    for (int i = 0; i < nready; i++)
        rs_pending_free(ready[i]);
    free(ready);
    return st;
}

/* Stall reports (rank 0) and the timeout; returns the next time either is due, or 0. */
static double check_deadlines(rs_engine_t *e) {
    rs_negotiator_t *n = &e->negotiator;
    double now = rs_now(), next = 0;
    int stalls = 0;
    if (e->comm->rank == 0 && e->config.stall_check_seconds > 0)
        next = rs_negotiator_stalls(n, now, e->config.stall_check_seconds, &stalls);
    uint64_t lane_stalls = e->lane ? rs_lane_stalls(e->lane) : 0;
    if (lane_stalls != e->lane_stalls_seen)
        stalls++;
    e->lane_stalls_seen = lane_stalls;
    /* (tensors that stall one after another make one report per stall period, not one
     * each: a report writes a file on every rank) */
    if (stalls && e->config.report_on_stall &&
        now - e->last_stall_report >= e->config.stall_check_seconds) {
        e->last_stall_report = now;
        rs_engine_request_report(e, RS_REPORT_STALL);
    }
    rs_pending_t *oldest = NULL;
    for (size_t i = 0; i < n->pending.capacity; i++) {
        rs_pending_t *p = n->pending.keys[i] ? n->pending.values[i] : NULL;
        /* A joined rank may wait for the others' whole epoch: join has no deadline; nobody
         * waits for a refusal. */
        if (p && p->mine && p->mine->meta.kind != RS_KIND_JOIN && !p->mine->refusal &&
            (!oldest || p->mine->submitted_at < oldest->mine->submitted_at))
            oldest = p;
    }
    if (!oldest || e->comm->timeout_seconds <= 0)
        return next; /* no hard limit: stalls are reported, dead peers seen by their sockets */
    double due = oldest->mine->submitted_at + e->comm->timeout_seconds;
    if (now < due)
        return next && next < due ? next : due;
    char text[RS_ERROR_LEN], missing[512];
    rs_pending_ranks(oldest, n->size, 0, missing, sizeof missing);
    rs_submit_timeout_text(e->comm, oldest->name, oldest->mine->meta.kind,
                           now - oldest->mine->submitted_at, missing, text, sizeof text);
    rs_fail(e->comm, RS_ERR_TIMEOUT, "%s", text);
    rs_engine_fail(e, RS_ERR_TIMEOUT, text);
    return 0;
}

static int has_local_pending(const rs_engine_t *e) {
    const rs_map_t *m = &e->negotiator.pending;
    for (size_t i = 0; i < m->capacity; i++)
        if (m->keys[i] && ((rs_pending_t *)m->values[i])->mine)
            return 1;
    return 0;
}

/* The peers whose bytes may start a round this rank must join: the left neighbour (the
 * ring), the right one (Bruck's log-round gather, whose first step sends to rank - 1),
 * and with a power-of-two size every recursive-doubling partner (rank ^ 2^k: a rank
 * hears first from the partner of the round in which the ranks that started reach it). */
static int round_starters(const rs_comm_t *comm, rs_wait_t *waits) {
    int n = comm->size, k = 1;
    waits[0] = (rs_wait_t){.peer = RS_WAKE_PEER, .want_read = 1};
    if (n > 1)
        waits[k++] = (rs_wait_t){.peer = (comm->rank + n - 1) % n, .want_read = 1};
    if (n > 2)
        waits[k++] = (rs_wait_t){.peer = (comm->rank + 1) % n, .want_read = 1};
    for (int d = 2; (n & (n - 1)) == 0 && d < n; d *= 2)
        waits[k++] = (rs_wait_t){.peer = comm->rank ^ d, .want_read = 1};
    return k;
}

static int any_peer_ready(const rs_wait_t *waits, int n) {
    for (int k = 1; k < n; k++)
        if (waits[k].ready)
            return 1;
    return 0;
}

/* Block until a local submission, a peer starting a round, a deadline, or a lost peer.
 * Returns 1 when a peer has started a round that this rank must join. */
static int idle_wait(rs_engine_t *e, double next_deadline) {
    rs_comm_t *comm = e->comm;
    rs_wait_t waits[3 + 32];
    int nwaits = round_starters(comm, waits);
    double left = next_deadline > 0 ? next_deadline - rs_now() : 1.0;
    int timeout_ms = left <= 0 ? 0 : left > 1.0 ? 1000 : (int)(left * 1000) + 1;
    int lost = -1;
    pthread_mutex_lock(&e->mu);
    int busy = e->queue_head || e->stopping; /* checked under the lock: no lost wakeup */
    e->sleeping = !busy;
    pthread_mutex_unlock(&e->mu);
    if (busy)
        return 0;
    rs_status_t st = comm->transport->poll(comm, waits, nwaits, timeout_ms, &lost);
    pthread_mutex_lock(&e->mu);
    e->sleeping = 0;
    pthread_mutex_unlock(&e->mu);
    drain_wake_pipe(e);
    /* A peer gone while nothing of ours waits may just have shut down first; the next
     * round finds out for sure. With our tensors waiting on it, fail them now. */
    if (st == RS_OK && lost >= 0 && has_local_pending(e))
        st = rs_fail_lost_peer(comm, lost);
    if (st != RS_OK) {
        fail_with_comm_error(e, st);
        return 0;
    }
    return any_peer_ready(waits, nwaits);
}

/* ---- a peer that shuts down ----
 *
 * shutdown() is a barrier of every rank's engine (SHUTDOWN_NAME), so that no rank's exit
 * looks like a failure to the others. A rank that shuts down while its peers still wait in
 * collectives with it (it finished early, or left on an exception or sys.exit) would wait
 * for them in that barrier, and they for it. So once a peer's shutdown shows in
 * negotiation, every collective here fails naming it: those waiting now (in negotiation or
 * on the same-host lane) and later ones (Horovod's "Horovod has been shut down"). Messages
 * between ranks still running go on; this rank's own shutdown() then completes the
 * barrier. */

static int is_collective_entry(const rs_pending_t *p) {
    return !rs_pending_is_p2p(p) && strcmp(p->name, SHUTDOWN_NAME) != 0;
}

/* A message to or from a rank that shut down, or a collective: it can never complete. */
static int needs_shut_down_rank(const rs_engine_t *e, const rs_pending_t *p) {
    if (is_collective_entry(p))
        return 1;
    const rs_meta_t *m = &p->metas[p->last_rank];
    return rs_pending_is_p2p(p) && (e->shut_down[m->root] || e->shut_down[m->op]);
}

/* Under mu: drop the pending entries that need a rank that shut down (every rank still
 * running drops the same ones, after the same round); this rank's requests among them fail. */
static void fail_what_needs_shut_down_locked(rs_engine_t *e) {
    rs_negotiator_t *n = &e->negotiator;
    for (size_t i = 0; i < n->pending.capacity; i++) {
        rs_pending_t *p = n->pending.keys[i] ? n->pending.values[i] : NULL;
        if (!p || !needs_shut_down_rank(e, p))
            continue;
        rs_work_t *w = p->mine;
        n->my_blocking_pending -= w && w->blocking_seq;
        if (p == n->join)
            n->join = NULL;
        rs_map_remove(&n->pending, p->name);
        rs_pending_free(p);
        i = (size_t)-1; /* the map changed under the scan: start over */
        if (!w)
            continue;
        if (w->synthetic) {
            rs_work_free(w);
        } else if (w->refusal) {
            drop_refusal_locked(e, w);
        } else {
            w->status = RS_ERR_COMM;
            free(w->error);
            w->error = strdup(e->closed_text);
            finish_locked(e, w);
        }
    }
    pthread_cond_broadcast(&e->done_cv);
}

/* After each round: note peers whose shutdown negotiation now holds (while this rank has
 * not shut down itself) and fail what can no longer complete. */
static void close_collectives(rs_engine_t *e) {
    rs_pending_t *p = rs_map_get(&e->negotiator.pending, SHUTDOWN_NAME);
    if (!p || p->mine)
        return; /* nobody, or this rank shuts down too: the barrier ends it all */
    pthread_mutex_lock(&e->mu);
    for (int r = 0; r < e->comm->size; r++) {
        if (!p->submitted[r] || r == e->comm->rank || e->shut_down[r])
            continue;
        e->shut_down[r] = 1;
        if (!e->collectives_closed)
            snprintf(e->closed_text, sizeof e->closed_text, "rank %d has shut down (it "
                     "finished, or left on an error), so no collective with it can complete "
                     "(every rank must make the same collectives before shutdown())", r);
        e->collectives_closed = 1;
        __atomic_store_n(&e->lane_stop, RS_ERR_COMM, __ATOMIC_RELEASE);
    }
    if (e->collectives_closed)
        fail_what_needs_shut_down_locked(e);
    pthread_mutex_unlock(&e->mu);
}

static void *engine_main(void *arg) {
    rs_engine_t *e = arg;
    rs_work_t **batch = NULL;
    int cap = 0, peer_started = 0;
    for (;;) {
        int n = 0;
        pthread_mutex_lock(&e->mu);
        take_queue_locked(e, &batch, &n, &cap);
        int stopping = e->stopping, failed = e->failure.code != RS_OK;
        pthread_mutex_unlock(&e->mu);
        if (failed) {
            drop_negotiation(e);
            fail_batch(e, batch, n);
            if (stopping)
                break;
            struct pollfd p = {.fd = e->wake[0], .events = POLLIN};
            poll(&p, 1, 1000); /* sleep until stopped */
            drain_wake_pipe(e);
            continue;
        }
        if (n == 0 && !peer_started && !report_to_ask(e)) {
            if (stopping)
                break;
            peer_started = idle_wait(e, check_deadlines(e));
            continue;
        }
        if (n > 0 && e->executor.cycle_time_ms > 0)
            gather_more(e, &batch, &n, &cap);
        peer_started = 0;
        rs_timeline_cycle(&e->timeline, rs_now()); /* (locks: the timeline may start now) */
        rs_status_t st = run_round(e, batch, n);
        if (st != RS_OK) {
            fail_with_comm_error(e, st);
            fail_batch(e, batch, n); /* those the round never recorded */
        } else {
            close_collectives(e);
        }
    }
    free(batch);
    return NULL;
}

/* ---- lifecycle ---- */

/* The configured settings, as rs_engine_settings reports them (before the thread runs). */
static void record_settings(rs_executor_t *x) {
    x->settings[RS_TUNE_FUSION_THRESHOLD] = x->fusion_threshold;
    x->settings[RS_TUNE_CYCLE_TIME_US] = (int64_t)(x->cycle_time_ms * 1e3 + 0.5);
    x->settings[RS_TUNE_STAGED_BYTES] = (int64_t)x->staged_min_bytes;
    x->settings[RS_TUNE_SMALL_ALLREDUCE] =
        (int64_t)__atomic_load_n(&x->comm->small_allreduce_bytes, __ATOMIC_RELAXED);
}

void rs_engine_settings(rs_engine_t *e, int64_t *out) {
    for (int i = 0; i < RS_TUNE_COUNT; i++)
        out[i] = __atomic_load_n(&e->executor.settings[i], __ATOMIC_RELAXED);
}

static void engine_free(rs_engine_t *e) {
    if (e->wake[0] >= 0)
        close(e->wake[0]);
    if (e->wake[1] >= 0)
        close(e->wake[1]);
    for (int i = 0; i < e->nslots; i++)
        if (e->slots[i])
            rs_work_free(e->slots[i]);
    free(e->slots);
    free(e->generations);
    rs_map_free(&e->in_flight);
    free(e->p2p_sent);
    free(e->shut_down);
    free(e->p2p_received);
    rs_negotiator_free(&e->negotiator);
    rs_flight_free(&e->flight);
    rs_stragglers_free(&e->stragglers);
    free(e->round_waits);
    free(e->report_items);
    free(e->report_submitted);
    rs_timeline_stop(&e->timeline);
    pthread_mutex_destroy(&e->timeline.mu);
    free(e->executor.fusion);
    rs_lane_free(e->lane);
    rs_lane_free(e->executor.staged);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->done_cv);
    pthread_cond_destroy(&e->report_cv);
    free(e);
}

/* Everything but the thread and the lanes; -1 when some part could not be had. */
static int engine_init(rs_engine_t *e, rs_comm_t *comm, const rs_engine_config_t *config) {
    e->comm = comm;
    e->config = *config;
    e->wake[0] = e->wake[1] = -1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* (rs_engine_wait's deadline) */
    pthread_cond_init(&e->done_cv, &attr);
    pthread_cond_init(&e->report_cv, &attr); /* (its own: completions do not wake it) */
    pthread_condattr_destroy(&attr);
    rs_timeline_init(&e->timeline, comm->rank);
    e->executor = (rs_executor_t){.comm = comm, .fusion_threshold = config->fusion_threshold_bytes,
                                  .cycle_time_ms = config->cycle_time_ms,
                                  .timeline = &e->timeline};
    e->p2p_sent = calloc((size_t)comm->size, sizeof *e->p2p_sent);
    e->p2p_received = calloc((size_t)comm->size, sizeof *e->p2p_received);
    e->shut_down = calloc((size_t)comm->size, 1);
    e->round_waits = calloc((size_t)comm->size, sizeof *e->round_waits);
    /* (no flight records: no straggler events either, to measure what keeping them costs) */
    int records = rs_flight_init(&e->flight, config->flight_records) |
                  rs_stragglers_init(&e->stragglers,
                                     config->flight_records > 0 ? STRAGGLER_EVENTS : 0);
    if (!e->p2p_sent || !e->p2p_received || !e->shut_down || !e->round_waits || records ||
        rs_negotiator_init(&e->negotiator, comm, config->cache_capacity) != RS_OK ||
        pipe2(e->wake, O_NONBLOCK | O_CLOEXEC) != 0)
        return -1;
    return 0;
}

/* The calling threads' lane and the executor's staged instance, each in its own area of
 * the shared segments; NULL (the engine runs everything) unless every rank is on this
 * host. */
static void open_lanes(rs_engine_t *e, const rs_engine_config_t *config) {
    rs_comm_t *comm = e->comm;
    if (config->lane_max_bytes > 0)
        e->lane = rs_lane_create(comm, 0, config->lane_spin_seconds,
                                 config->stall_check_seconds, (size_t)config->lane_max_bytes);
    /* Every rank on this host (the lane's condition), whose cores the spin time was chosen
     * for: the engine's waits may spin while a caller waits. (Ranks on several hosts may
     * share cores the topology cannot see, as namespace hosts on one machine do.) */
    if (e->lane)
        comm->waiting_spin_seconds = config->lane_spin_seconds;
    if (config->staged_min_bytes > 0) {
        e->executor.staged = rs_lane_create(comm, 1, comm->spin_seconds, 0, 0);
        e->executor.staged_min_bytes = (size_t)config->staged_min_bytes;
    }
}

rs_status_t rs_engine_create(rs_comm_t *comm, const rs_engine_config_t *config,
                             rs_engine_t **out_engine) {
    if (comm->engine_attached)
        return rs_fail(comm, RS_ERR_USAGE, "the communicator already has an engine");
    rs_engine_t *e = calloc(1, sizeof *e);
    if (!e)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    if (engine_init(e, comm, config) != 0) {
        engine_free(e);
        return rs_fail(comm, RS_ERR_SYSTEM, "cannot set up the engine");
    }
    open_lanes(e, config);
    record_settings(&e->executor);
    comm->wake_fd = e->wake[0];
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        comm->wake_fd = -1;
        engine_free(e);
        return rs_fail(comm, RS_ERR_SYSTEM, "cannot start the engine thread");
    }
    e->thread_started = 1;
    comm->engine_attached = 1;
    *out_engine = e;
    return RS_OK;
}

void rs_engine_stop_thread(rs_engine_t *e) {
    if (!e->thread_started)
        return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_mutex_unlock(&e->mu);
    rs_engine_wake(e);
    pthread_join(e->thread, NULL);
    e->thread_started = 0;
}

rs_status_t rs_engine_abort(rs_engine_t *e, const char *reason) {
    /* rs_engine_fail only shuts the sockets down (no close), which the engine thread,
     * possibly blocked in poll on them, sees as a failed round. */
    rs_engine_fail(e, RS_ERR_COMM, reason ? reason : "aborted");
    rs_engine_wake(e);
    return RS_OK;
}

void rs_engine_destroy(rs_engine_t *e) {
    if (!e)
        return;
    rs_engine_stop_thread(e);
    pthread_mutex_lock(&e->mu);
    set_failure_locked(e, RS_ERR_COMM, "the engine was shut down");
    for (int i = 0; i < e->nslots; i++)
        if (e->slots[i] && !e->slots[i]->done)
            fail_locked(e, e->slots[i]);
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
    e->comm->wake_fd = -1;
    e->comm->engine_attached = 0;
    engine_free(e);
}

rs_status_t rs_engine_start_timeline(rs_engine_t *e, const char *path, int mark_cycles) {
    rs_status_t st = rs_timeline_start(&e->timeline, path, mark_cycles);
    if (st == RS_OK)
        return RS_OK;
    pthread_mutex_lock(&e->mu);
    rs_error_set(&e->error, st, "%s '%s'", st == RS_ERR_USAGE
                     ? "a timeline is already being written; cannot start"
                     : "cannot open the timeline file (a symbolic link there is refused)", path);
    pthread_mutex_unlock(&e->mu);
    return st;
}

rs_status_t rs_engine_stop_timeline(rs_engine_t *e) {
    rs_timeline_stop(&e->timeline);
    return RS_OK;
}
