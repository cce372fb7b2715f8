/* The engine: a background thread per communicator. Callers submit requests and get
 * handles at once; the thread negotiates with the other ranks, runs what is ready (fused)
 * and completes the handles. It never sleeps a fixed cycle: while idle it blocks in poll
 * on its left neighbour (a peer starting a negotiation round) and on a self-pipe
 * (a local submission). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"

#define FUSION_IDLE_GAP_SECONDS 100e-6 /* stop gathering once submissions pause this long */
#define SHUTDOWN_NAME "ringsync.shutdown"
/* Sends and recvs one rank may have in flight: every rank's negotiator holds an entry for
 * each until it is matched, so a rank that posts without end is refused, not followed. */
#define P2P_MAX_IN_FLIGHT 4096

struct rs_engine {
    rs_comm_t *comm;
    rs_engine_config_t config;
    pthread_t thread;
    int thread_started;
    int wake[2]; /* self-pipe: submissions and stop requests wake the thread */

    pthread_mutex_t mu; /* guards everything down to `error` */
    pthread_cond_t done_cv;
    rs_work_t *queue_head, *queue_tail;
    rs_work_t **slots;
    uint32_t *generations;
    int nslots;
    rs_map_t in_flight; /* names of this rank's unfinished requests */
    int stopping;
    int sleeping; /* the thread blocks on the self-pipe: a submission must write to it */
    /* The thread gathers a burst (gather_more): it looks at the queue every idle gap by
     * itself, so only a request someone waits for (start_now) must wake it. Waking it
     * for every arrival cost a pipe write and a thread switch per tensor. */
    int gathering;
    /* Once set, every pending and later request fails with it. Written once, by the
     * thread that fails the engine; its code is also read atomically, without mu, by a
     * caller waiting on the same-host lane. */
    rs_error_t failure;
    /* Why a calling thread's last call failed (rs_engine_last_error): written by calling
     * threads only, never by the engine thread. */
    rs_error_t error;
    /* Joins completed on this rank: written by the engine thread (under mu, before the
     * join's handle is done), read atomically by lane callers, which tag their posts with
     * it (see rs_direct_serve_joined). */
    uint32_t joins;
    /* Point-to-point: unnamed sends accepted to each rank, unnamed recvs accepted from
     * each (size entries each, under mu): the k-th of each pair gets the same name. */
    int64_t *p2p_sent, *p2p_received;
    int p2p_in_flight; /* this rank's sends and recvs not yet done (under mu) */
    /* Blocking calls of one tensor submitted (under mu): the k-th gets blocking_seq k, and
     * negotiation matches the k-th of every rank (see rs_request_t.blocking). */
    uint64_t blocking_calls;
    /* Peers that shut down while this rank still runs (see close_collectives; under mu):
     * shut_down[r], and once any did, collectives fail with these words. */
    unsigned char *shut_down;
    int collectives_closed;
    char closed_text[RS_ERROR_LEN];
    /* What stops a caller waiting on the same-host lane (read atomically): the failure's
     * code, or RS_ERR_COMM once collectives are closed. */
    rs_status_t lane_stop;

    /* the engine thread's own */
    rs_negotiator_t negotiator;
    rs_executor_t executor;
    rs_timeline_t timeline;

    rs_direct_t *direct; /* the same-host lane for blocking allreduces, or NULL */
};

void rs_free(void *p) { free(p); }

/* ---- handles ---- */

static int64_t handle_of(rs_engine_t *e, int slot) {
    return ((int64_t)e->generations[slot] << 32) | slot;
}

/* Under mu. NULL for a handle that is unknown or already released. */
static rs_work_t *work_of(rs_engine_t *e, int64_t handle) {
    int slot = (int)(handle & 0xffffffff);
    if (handle < 0 || slot >= e->nslots || !e->slots[slot] || handle_of(e, slot) != handle)
        return NULL;
    return e->slots[slot];
}

static int take_slot(rs_engine_t *e) {
    for (int i = 0; i < e->nslots; i++)
        if (!e->slots[i])
            return i;
    int grown = e->nslots ? e->nslots * 2 : 64;
    rs_work_t **slots = realloc(e->slots, (size_t)grown * sizeof *slots);
    if (slots)
        e->slots = slots;
    uint32_t *gens = realloc(e->generations, (size_t)grown * sizeof *gens);
    if (gens)
        e->generations = gens;
    if (!slots || !gens)
        return -1;
    for (int i = e->nslots; i < grown; i++) {
        e->slots[i] = NULL;
        e->generations[i] = 1;
    }
    int first = e->nslots;
    e->nslots = grown;
    return first;
}

static void free_work(rs_work_t *w) {
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
    __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE); /* a joined rank's lane reads it */
    rs_map_remove(&e->in_flight, w->name);
}

/* Under mu: a refusal is done once negotiated (or failed): nobody waits for it. */
static void drop_refusal_locked(rs_engine_t *e, rs_work_t *w) {
    if (rs_map_get(&e->in_flight, w->name) == w)
        rs_map_remove(&e->in_flight, w->name);
    free_work(w);
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

static void wake_thread(rs_engine_t *e);

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
    wake_thread(e);
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
            free_work(p->mine); /* the engine's own (a joined rank's zeros): no handle */
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

static void wake_thread(rs_engine_t *e) {
    char c = 1;
    if (write(e->wake[1], &c, 1) < 0 && errno != EAGAIN) {
        /* a full pipe already wakes the thread */
    }
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

static int any_request_starts_now(const rs_request_t *requests, int n) {
    for (int i = 0; i < n; i++)
        if (requests[i].start_now)
            return 1;
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
            free_work(w);
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
        if (w->status == (rs_status_t)-1) { /* not run: a failure stopped the round */
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
        w->status = (rs_status_t)-1;
        if (e->timeline.file && !w->synthetic && !w->refusal)
            rs_timeline_span(&e->timeline, w->meta.kind, ready[i]->name, RS_SPAN_NEGOTIATE,
                             w->submitted_at, now);
    }
    return RS_OK;
}

/* One negotiation round and the work it makes ready. */
static rs_status_t run_round(rs_engine_t *e, rs_work_t **batch, int nbatch) {
    rs_pending_t **ready = NULL;
    int nready = 0;
    RS_CHECK(rs_negotiate(e->comm, &e->negotiator, batch, nbatch, &ready, &nready));
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
    if (e->comm->rank == 0 && e->config.stall_check_seconds > 0)
        next = rs_negotiator_stalls(n, now, e->config.stall_check_seconds);
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

/* Block until a local submission, a peer starting a round, a deadline, or a lost peer.
 * Returns 1 when a peer has started a round that this rank must join. A round's first
 * bytes come from the left neighbour (the ring) or the right one (the log-round gather,
 * whose first step sends to rank - 1): both are watched. */
static int idle_wait(rs_engine_t *e, double next_deadline) {
    rs_comm_t *comm = e->comm;
    rs_wait_t waits[3] = {{.peer = RS_WAKE_PEER, .want_read = 1},
                          {.peer = (comm->rank + comm->size - 1) % comm->size, .want_read = 1},
                          {.peer = (comm->rank + 1) % comm->size, .want_read = 1}};
    int nwaits = comm->size > 2 ? 3 : comm->size > 1 ? 2 : 1;
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
    return (nwaits > 1 && waits[1].ready) || (nwaits > 2 && waits[2].ready);
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
            free_work(w);
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
        if (n == 0 && !peer_started) {
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

/* ---- public API ---- */

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
            free_work(e->slots[i]);
    free(e->slots);
    free(e->generations);
    rs_map_free(&e->in_flight);
    free(e->p2p_sent);
    free(e->shut_down);
    free(e->p2p_received);
    rs_negotiator_free(&e->negotiator);
    rs_timeline_stop(&e->timeline);
    pthread_mutex_destroy(&e->timeline.mu);
    free(e->executor.fusion);
    rs_direct_free(e->direct);
    rs_direct_free(e->executor.staged);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->done_cv);
    free(e);
}

rs_status_t rs_engine_create(rs_comm_t *comm, const rs_engine_config_t *config,
                             rs_engine_t **out_engine) {
    if (comm->engine_attached)
        return rs_fail(comm, RS_ERR_USAGE, "the communicator already has an engine");
    rs_engine_t *e = calloc(1, sizeof *e);
    if (!e)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    e->comm = comm;
    e->config = *config;
    e->wake[0] = e->wake[1] = -1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&e->done_cv, &attr);
    pthread_condattr_destroy(&attr);
    rs_timeline_init(&e->timeline, comm->rank);
    e->executor = (rs_executor_t){.comm = comm, .fusion_threshold = config->fusion_threshold_bytes,
                                  .cycle_time_ms = config->cycle_time_ms,
                                  .timeline = &e->timeline};
    e->p2p_sent = calloc((size_t)comm->size, sizeof *e->p2p_sent);
    e->p2p_received = calloc((size_t)comm->size, sizeof *e->p2p_received);
    e->shut_down = calloc((size_t)comm->size, 1);
    if (!e->p2p_sent || !e->p2p_received || !e->shut_down ||
        rs_negotiator_init(&e->negotiator, comm->rank, comm->size, config->cache_capacity) != RS_OK ||
        pipe2(e->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
        engine_free(e);
        return rs_fail(comm, RS_ERR_SYSTEM, "cannot set up the engine");
    }
    if (config->lane_max_bytes > 0)
        e->direct = rs_direct_create(comm, 0, config->lane_spin_seconds,
                                     config->stall_check_seconds, (size_t)config->lane_max_bytes);
    if (config->staged_min_bytes > 0) {
        e->executor.staged = rs_direct_create(comm, 1, comm->spin_seconds, 0, 0);
        e->executor.staged_min_bytes = (size_t)config->staged_min_bytes;
    }
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

/* ---- checking and accepting requests (calling threads, under mu) ---- */

rs_meta_t rs_request_meta(const rs_request_t *r) {
    int reduces = r->kind == RS_KIND_ALLREDUCE || r->kind == RS_KIND_REDUCESCATTER;
    rs_meta_t m = {0};
    m.kind = r->kind;
    m.dtype = r->kind == RS_KIND_BARRIER || r->kind == RS_KIND_JOIN || r->kind == RS_KIND_TUNE
                  ? 0 : r->dtype;
    m.op = reduces ? r->op : 0; /* unused fields stay equal on every rank */
    m.root = r->kind == RS_KIND_BROADCAST ? r->root : 0;
    m.prescale = reduces ? r->prescale : 1.0;
    m.postscale = reduces ? r->postscale : 1.0;
    m.ndim = r->ndim;
    if (r->ndim > 0 && r->ndim <= RS_MAX_DIMS) /* (rs_meta_check refuses any other) */
        memcpy(m.shape, r->shape, (size_t)r->ndim * sizeof(int64_t));
    return m;
}

/* ---- point-to-point ----
 *
 * Why sends and recvs go through negotiation rather than around it: every byte between
 * two ranks travels on one stream per pair (TCP socket or shared-memory ring), which the
 * collectives use without framing; a message's bytes may only move where both ends expect
 * them, or they would be read as a negotiation round or a ring step. Negotiation already
 * gives every rank the same order of ready work, so a message becomes one more ready
 * entry: it is ready once its two ends have submitted it (no other rank waits for it),
 * every rank meets it at the same place in that order, and only its two ends move its
 * bytes (the sender's header is its negotiated metadata, already checked for bounds and
 * overflow; the payload is exactly the agreed size). Matching is by name: the engine
 * names a message after its ends and the caller's name, or, unnamed, after its place in
 * the pair's sequence, so the receiver's posted recv meets the sender's send whatever
 * order names are posted in. Nothing waits in an unexpected-message buffer: a send's
 * payload stays in the sender's buffer until the recv is posted (rendezvous), and what
 * negotiation keeps of unmatched messages is bounded (P2P_MAX_IN_FLIGHT per rank). The
 * cost: a message takes a negotiation round, in which every rank of the communicator
 * takes part (cheap, and shared with whatever else is submitted then). A lost peer fails the round, hence every pending
 * message, as it fails collectives. */

static int is_p2p(int kind) { return kind == RS_KIND_SEND || kind == RS_KIND_RECV; }

/* The metadata both ends of a message carry: kind "send", root the sender, op the
 * receiver. */
static rs_meta_t request_meta(rs_engine_t *e, const rs_request_t *r) {
    rs_meta_t m = rs_request_meta(r);
    if (is_p2p(r->kind)) {
        m.kind = RS_KIND_SEND;
        m.root = r->kind == RS_KIND_SEND ? e->comm->rank : r->root;
        m.op = r->kind == RS_KIND_SEND ? r->root : e->comm->rank;
    }
    return m;
}

/* Under mu: *out, the engine's name for the message (caller frees), or a refusal in the
 * engine's record. `earlier`: unnamed messages to the same peer and direction earlier in
 * the same group. */
static rs_status_t p2p_name(rs_engine_t *e, const char *name, const rs_request_t *r, int earlier,
                            char **out) {
    int size = e->comm->size, me = e->comm->rank, send = r->kind == RS_KIND_SEND;
    const char *what = send ? "send" : "recv", *role = send ? "destination" : "source";
    if (r->root < 0 || r->root >= size || r->root == me)
        return rs_error_set(&e->error, RS_ERR_USAGE, "%s: %s rank %d is out of range: not "
                            "one of ranks 0..%d other than this rank (%d)", what, role, r->root,
                            size - 1, me);
    int src = send ? me : r->root, dst = send ? r->root : me;
    if (name && *name && strlen(name) > RS_MAX_NAME_LEN - 64)
        return rs_error_set(&e->error, RS_ERR_USAGE, "%s: name '%.64s...' is longer than %d "
                            "characters", what, name, RS_MAX_NAME_LEN - 64);
    int64_t seq = (send ? e->p2p_sent : e->p2p_received)[r->root] + earlier;
    *out = name && *name ? rs_strdup_printf("%s (%d->%d)", name, src, dst)
                         : rs_strdup_printf("message #%lld (%d->%d)", (long long)seq, src, dst);
    return *out ? RS_OK : rs_error_set(&e->error, RS_ERR_NOMEM, "out of memory");
}

/* alltoall: splits (when given) are rows per rank, none negative, summing to shape[0]
 * without overflow; otherwise shape[0] must split evenly. */
static rs_status_t validate_splits(rs_engine_t *e, const char *name, const rs_request_t *r) {
    int size = e->comm->size;
    if (!r->splits) {
        if (r->shape[0] % size)
            return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s': first dimension %lld "
                                "is not divisible by %d ranks; pass splits", name,
                                (long long)r->shape[0], size);
        return RS_OK;
    }
    int64_t sum = 0;
    for (int i = 0; i < size; i++) {
        if (r->splits[i] < 0)
            return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s': negative alltoall "
                                "split %lld for rank %d", name, (long long)r->splits[i], i);
        if (rs_add_checked(sum, r->splits[i], &sum) != 0)
            return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s': alltoall splits "
                                "overflow when summed (split %lld for rank %d)", name,
                                (long long)r->splits[i], i);
    }
    if (sum != r->shape[0])
        return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s': alltoall splits sum to "
                            "%lld, not to the first dimension %lld", name, (long long)sum,
                            (long long)r->shape[0]);
    return RS_OK;
}

/* Check one request on this rank alone (ranks are compared later, in negotiation). */
static rs_status_t validate(rs_engine_t *e, const char *name, const rs_request_t *r) {
    if (!name || !*name || strlen(name) > RS_MAX_NAME_LEN)
        return rs_error_set(&e->error, RS_ERR_USAGE, "tensor name '%.64s' must have 1 to %d "
                            "characters", name ? name : "", RS_MAX_NAME_LEN);
    if (rs_map_get(&e->in_flight, name))
        return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s' is already in flight on "
                            "rank %d; synchronize it before submitting the name again", name,
                            e->comm->rank);
    rs_meta_t m = request_meta(e, r);
    rs_error_t why;
    if (rs_meta_check(&m, e->comm->size, &why, NULL, NULL) != RS_OK)
        return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s': %s", name, why.text);
    int needs_rows = r->kind == RS_KIND_ALLGATHER || r->kind == RS_KIND_ALLTOALL ||
                     r->kind == RS_KIND_REDUCESCATTER;
    if (needs_rows && r->ndim < 1)
        return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s': %s needs at least one "
                            "dimension", name, rs_kind_name(r->kind));
    return r->kind == RS_KIND_ALLTOALL ? validate_splits(e, name, r) : RS_OK;
}

static rs_work_t *new_work(rs_engine_t *e, const char *name, const rs_request_t *r) {
    rs_work_t *w = calloc(1, sizeof *w);
    if (!w || !(w->name = strdup(name))) {
        free(w);
        return NULL;
    }
    w->meta = request_meta(e, r);
    w->sendbuf = r->sendbuf;
    w->recvbuf = r->recvbuf;
    w->start_now = r->start_now;
    if (r->kind == RS_KIND_ALLTOALL) {
        int size = e->comm->size;
        if (!(w->splits = malloc((size_t)size * sizeof(int64_t)))) {
            free_work(w);
            return NULL;
        }
        for (int i = 0; i < size; i++)
            w->splits[i] = r->splits ? r->splits[i] : r->shape[0] / size;
    }
    return w;
}

/* Under mu, once a peer shut down (close_collectives): a collective cannot run any more (but
 * this rank's own shutdown), nor a message to or from a rank that shut down. */
static rs_status_t check_still_possible(rs_engine_t *e, const char *name, const rs_request_t *r) {
    int peer = is_p2p(r->kind) && r->root >= 0 && r->root < e->comm->size ? r->root : -1;
    if (is_p2p(r->kind) ? peer < 0 || !e->shut_down[peer] : strcmp(name, SHUTDOWN_NAME) == 0)
        return RS_OK;
    if (peer >= 0)
        return rs_error_set(&e->error, RS_ERR_COMM, "rank %d has shut down: no message to or "
                            "from it can complete", peer);
    return rs_error_set(&e->error, RS_ERR_COMM, "%s", e->closed_text);
}

/* Under mu: check every request first, so that a group is accepted whole or not at all. */
static rs_status_t validate_all(rs_engine_t *e, const char **names, const rs_request_t *requests,
                                int n) {
    if (e->failure.code != RS_OK)
        return rs_error_copy(&e->error, &e->failure);
    for (int i = 0; e->collectives_closed && i < n; i++)
        RS_CHECK(check_still_possible(e, names[i], &requests[i]));
    if (e->stopping)
        return rs_error_set(&e->error, RS_ERR_USAGE, "the engine is shutting down");
    for (int i = 0; i < n; i++) {
        RS_CHECK(validate(e, names[i], &requests[i]));
        for (int j = 0; j < i; j++)
            if (strcmp(names[i], names[j]) == 0)
                return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%s' appears twice in "
                                    "one group", names[i]);
    }
    return RS_OK;
}

rs_status_t rs_engine_validate(rs_engine_t *e, const char *name, const rs_request_t *r) {
    pthread_mutex_lock(&e->mu);
    rs_status_t st = validate_all(e, &name, r, 1);
    pthread_mutex_unlock(&e->mu);
    return st;
}

/* Under mu: forget the first n requests of a group that could not be accepted whole. */
static void drop_accepted(rs_engine_t *e, const int64_t *handles, int n) {
    for (int i = 0; i < n; i++) {
        rs_work_t *w = work_of(e, handles[i]);
        rs_map_remove(&e->in_flight, w->name);
        e->slots[handles[i] & 0xffffffff] = NULL;
        free_work(w);
    }
}

/* Under mu: a slot and a request for each of the group, or (out of memory) none. */
static rs_status_t accept_all(rs_engine_t *e, const char **names, const rs_request_t *requests,
                              int n, int64_t *handles) {
    for (int i = 0; i < n; i++) {
        rs_work_t *w = new_work(e, names[i], &requests[i]);
        int slot = w ? take_slot(e) : -1;
        if (slot < 0 || rs_map_put(&e->in_flight, w->name, w) != 0) {
            if (w)
                free_work(w);
            drop_accepted(e, handles, i);
            return rs_error_set(&e->error, RS_ERR_NOMEM, "out of memory submitting '%s'",
                                names[i]);
        }
        e->slots[slot] = w;
        w->handle = handles[i] = handle_of(e, slot);
    }
    return RS_OK;
}

/* Under mu. */
static void enqueue_locked(rs_engine_t *e, rs_work_t *w) {
    w->submitted_at = rs_now();
    if (e->queue_tail)
        e->queue_tail->next = w;
    else
        e->queue_head = w;
    e->queue_tail = w;
}

/* Under mu: the whole group at once, so that it negotiates in one round. */
static void queue_all(rs_engine_t *e, const int64_t *handles, int n) {
    for (int i = 0; i < n; i++)
        enqueue_locked(e, work_of(e, handles[i]));
}

/* Under mu: queue a refusal of `name` (see rs_engine_refuse); 1 if one was queued. None
 * for a name every rank's own check refuses alike (empty, too long), for one already in
 * flight here (that request is this rank's own and goes on), for a message (only its two
 * ends wait for it, and they match by their own sequence), or once the engine failed. */
static int refuse_locked(rs_engine_t *e, const char *name, int kind, uint64_t blocking_seq) {
    if (e->failure.code != RS_OK || e->stopping || !name || !*name ||
        strlen(name) > RS_MAX_NAME_LEN || rs_map_get(&e->in_flight, name) || is_p2p(kind) ||
        kind == RS_KIND_JOIN || kind == RS_KIND_TUNE)
        return 0;
    rs_work_t *w = calloc(1, sizeof *w);
    if (!w || !(w->name = strdup(name))) {
        free(w);
        return 0; /* out of memory: the peers' call waits, as it did before refusals */
    }
    w->meta = rs_refusal_meta(kind);
    w->refusal = w->start_now = 1;
    w->blocking_seq = blocking_seq;
    w->handle = -1;
    if (rs_map_put(&e->in_flight, w->name, w) != 0) {
        free_work(w);
        return 0;
    }
    enqueue_locked(e, w);
    return 1;
}

/* Under mu: wake the engine thread if it sleeps or gathers (returns whether to). */
static int must_wake_locked(rs_engine_t *e, int urgent) {
    int wake = e->sleeping || (e->gathering && urgent);
    if (wake) /* one wake-up per sleep: later submitters find the flags down */
        e->sleeping = e->gathering = 0;
    return wake;
}

/* Under mu: the blocking sequence number of a submission of n requests (0: none). Every
 * blocking call of one tensor takes one, refused or not, so that ranks count alike. */
static uint64_t next_blocking_seq(rs_engine_t *e, const rs_request_t *requests, int n) {
    int k = n == 1 ? requests[0].kind : -1;
    int counts = n == 1 && requests[0].blocking && !is_p2p(k) && k != RS_KIND_JOIN &&
                 k != RS_KIND_TUNE;
    return counts ? ++e->blocking_calls : 0;
}

void rs_engine_refuse_later(rs_engine_t *e, const char *name, int kind, int blocking) {
    pthread_mutex_lock(&e->mu);
    uint64_t seq = blocking && !is_p2p(kind) ? ++e->blocking_calls : 0;
    int wake = refuse_locked(e, name, kind, seq) && must_wake_locked(e, 1);
    pthread_mutex_unlock(&e->mu);
    if (wake)
        wake_thread(e);
}

/* Under mu: names[i] for a collective, the message's name for a send or recv (made[i],
 * which the caller frees). */
static rs_status_t name_messages(rs_engine_t *e, const char **names, const rs_request_t *requests,
                                 int n, const char **use, char **made) {
    int posted = e->p2p_in_flight;
    for (int i = 0; i < n; i++) {
        use[i] = names[i];
        if (!is_p2p(requests[i].kind))
            continue;
        int earlier = 0;
        for (int j = 0; j < i; j++)
            earlier += requests[j].kind == requests[i].kind &&
                       requests[j].root == requests[i].root && !(names[j] && *names[j]);
        if (posted++ >= P2P_MAX_IN_FLIGHT)
            return rs_error_set(&e->error, RS_ERR_USAGE, "%s: rank %d already has %d sends "
                                "and recvs in flight, the most it may; synchronize some "
                                "first (each waits for its peer's matching call)",
                                rs_kind_name(requests[i].kind), e->comm->rank,
                                P2P_MAX_IN_FLIGHT);
        RS_CHECK(p2p_name(e, names[i], &requests[i], earlier, &made[i]));
        use[i] = made[i];
    }
    return RS_OK;
}

/* Under mu, once a group is accepted: its messages count as in flight, and its unnamed
 * ones take their places in their pairs' order. */
static void count_messages(rs_engine_t *e, const char **names, const rs_request_t *requests,
                           int n) {
    for (int i = 0; i < n; i++) {
        e->p2p_in_flight += is_p2p(requests[i].kind);
        if (is_p2p(requests[i].kind) && !(names[i] && *names[i]))
            (requests[i].kind == RS_KIND_SEND ? e->p2p_sent : e->p2p_received)[requests[i].root]++;
    }
}

rs_status_t rs_engine_submit(rs_engine_t *e, const char **names, const rs_request_t *requests,
                             int n, int64_t *handles) {
    rs_status_t st;
    int wake = 0;
    const char **use = n > 0 ? calloc((size_t)n, sizeof *use) : NULL;
    char **made = n > 0 ? calloc((size_t)n, sizeof *made) : NULL;
    pthread_mutex_lock(&e->mu);
    if (n > 0 && (!use || !made))
        RS_CHECK_GOTO(rs_error_set(&e->error, RS_ERR_NOMEM, "out of memory"), st, out);
    if (n > 0)
        RS_CHECK_GOTO(name_messages(e, names, requests, n, use, made), st, out);
    uint64_t blocking_seq = next_blocking_seq(e, requests, n);
    st = validate_all(e, use, requests, n);
    if (st == RS_ERR_USAGE) { /* the peers' matching calls must fail too, not wait */
        int refused = 0;
        for (int i = 0; i < n; i++)
            refused |= refuse_locked(e, use[i], requests[i].kind, blocking_seq);
        wake = refused && must_wake_locked(e, 1);
    }
    RS_CHECK_GOTO(st, st, out);
    RS_CHECK_GOTO(accept_all(e, use, requests, n, handles), st, out);
    if (blocking_seq)
        work_of(e, handles[0])->blocking_seq = blocking_seq;
    count_messages(e, names, requests, n);
    queue_all(e, handles, n);
    wake = must_wake_locked(e, any_request_starts_now(requests, n));
out:
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; made && i < n; i++)
        free(made[i]);
    free(made);
    free(use);
    if (wake)
        wake_thread(e);
    return st;
}

int rs_engine_poll(rs_engine_t *e, int64_t handle) {
    pthread_mutex_lock(&e->mu);
    rs_work_t *w = work_of(e, handle);
    int done = w ? w->done : -1;
    pthread_mutex_unlock(&e->mu);
    return done;
}

rs_status_t rs_engine_wait(rs_engine_t *e, int64_t handle, double timeout_seconds, int *done) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    double t = (double)until.tv_sec + until.tv_nsec * 1e-9 + timeout_seconds;
    until.tv_sec = (time_t)t;
    until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
    pthread_mutex_lock(&e->mu);
    rs_work_t *w = work_of(e, handle);
    rs_status_t st = RS_ERR_USAGE;
    if (w && !w->done && !w->start_now) {
        w->start_now = 1; /* someone waits: stop gathering more into its fusion */
        if (e->sleeping || e->gathering) {
            e->sleeping = e->gathering = 0;
            wake_thread(e);
        }
    }
    if (w && e->direct && w->meta.kind == RS_KIND_JOIN) {
        /* A joined rank serves the same-host lane while it waits: it takes part in the
         * others' blocking allreduces with zeros until the join completes. */
        uint32_t epoch = e->joins; /* this join's: it has not completed (w not done) */
        pthread_mutex_unlock(&e->mu);
        rs_direct_serve_joined(e->direct, &w->done, epoch, t);
        pthread_mutex_lock(&e->mu);
    }
    while (w && !w->done && pthread_cond_timedwait(&e->done_cv, &e->mu, &until) != ETIMEDOUT) {
    }
    if (w)
        st = w->done ? w->status : RS_OK;
    else
        rs_error_set(&e->error, RS_ERR_USAGE, "unknown or released handle %lld",
                     (long long)handle);
    *done = w ? w->done : 0;
    pthread_mutex_unlock(&e->mu);
    return st;
}

const char *rs_engine_handle_error(rs_engine_t *e, int64_t handle) {
    pthread_mutex_lock(&e->mu);
    rs_work_t *w = work_of(e, handle);
    const char *text = w && w->error ? w->error : "";
    pthread_mutex_unlock(&e->mu);
    return text;
}

rs_status_t rs_engine_take_result(rs_engine_t *e, int64_t handle, void **data, int64_t *rows,
                                  int64_t *recv_splits) {
    pthread_mutex_lock(&e->mu);
    rs_work_t *w = work_of(e, handle);
    rs_status_t st = w && w->done && w->status == RS_OK ? RS_OK : RS_ERR_USAGE;
    if (st == RS_OK) {
        *data = w->result;
        *rows = w->result_rows;
        w->result = NULL;
        if (recv_splits && w->result_splits)
            memcpy(recv_splits, w->result_splits, (size_t)e->comm->size * sizeof(int64_t));
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

void rs_engine_release(rs_engine_t *e, int64_t handle) {
    pthread_mutex_lock(&e->mu);
    rs_work_t *w = work_of(e, handle);
    if (w && w->done) { /* a pending request stays: the engine still writes to it */
        int slot = (int)(handle & 0xffffffff);
        e->slots[slot] = NULL;
        e->generations[slot]++;
        free_work(w);
    }
    pthread_mutex_unlock(&e->mu);
}

const char *rs_engine_last_error(rs_engine_t *e) { return e->error.text; }

static void stop_thread(rs_engine_t *e) {
    if (!e->thread_started)
        return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_mutex_unlock(&e->mu);
    wake_thread(e);
    pthread_join(e->thread, NULL);
    e->thread_started = 0;
}

rs_status_t rs_engine_shutdown(rs_engine_t *e) {
    rs_request_t barrier = {.kind = RS_KIND_BARRIER, .start_now = 1};
    const char *name = SHUTDOWN_NAME;
    int64_t handle;
    rs_status_t st = rs_engine_submit(e, &name, &barrier, 1, &handle);
    int done = 0;
    while (st == RS_OK && !done)
        st = rs_engine_wait(e, handle, 1.0, &done);
    stop_thread(e);
    return st;
}

rs_status_t rs_engine_abort(rs_engine_t *e, const char *reason) {
    /* rs_engine_fail only shuts the sockets down (no close), which the engine thread,
     * possibly blocked in poll on them, sees as a failed round. */
    rs_engine_fail(e, RS_ERR_COMM, reason ? reason : "aborted");
    wake_thread(e);
    return RS_OK;
}

void rs_engine_destroy(rs_engine_t *e) {
    if (!e)
        return;
    stop_thread(e);
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

/* ---- lent to the same-host lane's glue (lane.c) ---- */

rs_direct_t *rs_engine_lane(rs_engine_t *e) { return e->direct; }

rs_comm_t *rs_engine_comm(rs_engine_t *e) { return e->comm; }

const rs_status_t *rs_engine_failure(rs_engine_t *e) { return &e->lane_stop; }

uint32_t rs_engine_joins(rs_engine_t *e) { return __atomic_load_n(&e->joins, __ATOMIC_ACQUIRE); }

rs_timeline_t *rs_engine_timeline(rs_engine_t *e) { return &e->timeline; }

rs_status_t rs_engine_report(rs_engine_t *e, rs_status_t st, const char *text) {
    pthread_mutex_lock(&e->mu);
    rs_error_set(&e->error, st, "%s", text);
    pthread_mutex_unlock(&e->mu);
    return st;
}

rs_status_t rs_engine_report_failure(rs_engine_t *e, rs_status_t st) {
    pthread_mutex_lock(&e->mu);
    rs_error_copy(&e->error, &e->failure);
    if (e->failure.code != RS_OK)
        st = e->failure.code;
    else if (e->collectives_closed) /* (what stopped a lane caller) */
        st = rs_error_set(&e->error, RS_ERR_COMM, "%s", e->closed_text);
    pthread_mutex_unlock(&e->mu);
    return st;
}
