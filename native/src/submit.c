/* The calling threads' side of the engine: checking a request (on this rank alone),
 * naming messages, accepting a group of requests whole and queueing it for the engine
 * thread (engine.c), then waiting for a handle, taking its result and releasing it. Also
 * the same-host lane's calling side: a blocking call runs on the calling thread through
 * lane.c, checked like a submission and failing like the engine.
 *
 * Above engine.c: it calls into the engine (engine.h) to wake, fail or stop it; the engine
 * thread calls nothing here. Errors: a refused call writes the engine's error record
 * (rs_engine_last_error) under the engine's mutex; the lane's record is read under the
 * lane's lock, right after the call that wrote it; a broken connection or a timeout on the
 * lane then fails the engine (which tells the peers). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checked.h"
#include "engine.h"
#include "lane.h"
#include "timeline.h"
#include "util.h"

/* Sends and recvs one rank may have in flight: every rank's negotiator holds an entry for
 * each until it is matched, so a rank that posts without end is refused, not followed. */
#define P2P_MAX_IN_FLIGHT 4096

/* ---- handles (under mu) ---- */

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

/* ---- checking and accepting requests (calling threads, under mu) ---- */

/* The metadata every rank compares for a request (unused fields zeroed). */
static rs_meta_t compared_meta(const rs_request_t *r) {
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
 * takes part (cheap, and shared with whatever else is submitted then). A lost peer fails
 * the round, hence every pending message, as it fails collectives. */

static int is_p2p(int kind) { return kind == RS_KIND_SEND || kind == RS_KIND_RECV; }

/* The metadata both ends of a message carry: kind "send", root the sender, op the
 * receiver. */
static rs_meta_t request_meta(rs_engine_t *e, const rs_request_t *r) {
    rs_meta_t m = compared_meta(r);
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

/* Error texts quote at most this many bytes of a name: names may have RS_MAX_NAME_LEN
 * bytes, a text RS_ERROR_LEN, and what is wrong must fit after the name. */
#define QUOTED_NAME_LEN 200

/* name, or its first QUOTED_NAME_LEN bytes and "..." in buf. */
static const char *quoted(const char *name, char buf[QUOTED_NAME_LEN + 4]) {
    if (strlen(name) <= QUOTED_NAME_LEN)
        return name;
    memcpy(buf, name, QUOTED_NAME_LEN);
    memcpy(buf + QUOTED_NAME_LEN, "...", 4);
    return buf;
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
    char cut[QUOTED_NAME_LEN + 4];
    int in_flight = rs_map_get(&e->in_flight, name) != NULL;
    name = quoted(name, cut); /* (from here on, for error texts only) */
    if (in_flight)
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
            rs_work_free(w);
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
static rs_status_t name_twice(rs_engine_t *e, const char *name) {
    return rs_error_set(&e->error, RS_ERR_USAGE, "tensor '%.64s' appears twice in one group",
                        name);
}

/* A group names each tensor once: pairwise for a few, through a map for many (a batch of
 * hundreds of gradients would otherwise cost n^2/2 comparisons per submission). */
static rs_status_t check_names_unique(rs_engine_t *e, const char **names, int n) {
    if (n <= 16) {
        for (int i = 1; i < n; i++)
            for (int j = 0; j < i; j++)
                if (strcmp(names[i], names[j]) == 0)
                    return name_twice(e, names[i]);
        return RS_OK;
    }
    rs_map_t seen = {0};
    rs_status_t st = RS_OK;
    for (int i = 0; i < n && st == RS_OK; i++) {
        if (rs_map_get(&seen, names[i]))
            st = name_twice(e, names[i]);
        else if (rs_map_put(&seen, names[i], (void *)names[i]) != 0)
            st = rs_error_set(&e->error, RS_ERR_NOMEM, "out of memory submitting '%.64s'",
                              names[i]);
    }
    rs_map_free(&seen);
    return st;
}

static rs_status_t validate_all(rs_engine_t *e, const char **names, const rs_request_t *requests,
                                int n) {
    if (e->failure.code != RS_OK)
        return rs_error_copy(&e->error, &e->failure);
    for (int i = 0; e->collectives_closed && i < n; i++)
        RS_CHECK(check_still_possible(e, names[i], &requests[i]));
    if (e->stopping)
        return rs_error_set(&e->error, RS_ERR_USAGE, "the engine is shutting down");
    for (int i = 0; i < n; i++)
        RS_CHECK(validate(e, names[i], &requests[i]));
    return check_names_unique(e, names, n);
}

/* Check a request as rs_engine_submit would (a refusal goes into the engine's record). */
static rs_status_t validate_one(rs_engine_t *e, const char *name, const rs_request_t *r) {
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
        rs_work_free(w);
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
                rs_work_free(w);
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
    w->flight_seq = rs_flight_begin(&e->flight, w->name, &w->meta, RS_ROUTE_ENGINE,
                                    w->submitted_at);
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
        rs_work_free(w);
        return 0;
    }
    enqueue_locked(e, w);
    return 1;
}

/* Whether someone waits for one of the group at once (start_now): then the engine thread
 * stops gathering a burst and runs. */
static int any_request_starts_now(const rs_request_t *requests, int n) {
    for (int i = 0; i < n; i++)
        if (requests[i].start_now)
            return 1;
    return 0;
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

/* Negotiate a refusal of `name` (a call of `kind` this rank refused) in the background:
 * the peers' request of that name fails, naming this rank (see rs_engine_refuse). */
static void refuse_later(rs_engine_t *e, const char *name, int kind, int blocking) {
    pthread_mutex_lock(&e->mu);
    uint64_t seq = blocking && !is_p2p(kind) ? ++e->blocking_calls : 0;
    int wake = refuse_locked(e, name, kind, seq) && must_wake_locked(e, 1);
    pthread_mutex_unlock(&e->mu);
    if (wake)
        rs_engine_wake(e);
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
        rs_engine_wake(e);
    return st;
}

/* ---- waiting and results ---- */

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
            rs_engine_wake(e);
        }
    }
    if (w && e->lane && w->meta.kind == RS_KIND_JOIN) {
        /* A joined rank serves the same-host lane while it waits: it takes part in the
         * others' blocking allreduces with zeros until the join completes. */
        uint32_t epoch = e->joins; /* this join's: it has not completed (w not done) */
        pthread_mutex_unlock(&e->mu);
        rs_lane_serve_joined(e->lane, &w->done, epoch, t);
        pthread_mutex_lock(&e->mu);
    }
    /* (the engine's shared-memory waits spin while a caller is blocked here) */
    __atomic_add_fetch(&e->comm->callers_waiting, 1, __ATOMIC_RELAXED);
    while (w && !w->done && pthread_cond_timedwait(&e->done_cv, &e->mu, &until) != ETIMEDOUT) {
    }
    __atomic_sub_fetch(&e->comm->callers_waiting, 1, __ATOMIC_RELAXED);
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
    } else {
        rs_error_set(&e->error, st, "handle %lld has no result to take (unknown, released, "
                     "not done, or failed)", (long long)handle);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

/* A result taken with rs_engine_take_result is the caller's to free. */
void rs_free(void *p) { free(p); }

void rs_engine_release(rs_engine_t *e, int64_t handle) {
    pthread_mutex_lock(&e->mu);
    rs_work_t *w = work_of(e, handle);
    if (w && w->done) { /* a pending request stays: the engine still writes to it */
        int slot = (int)(handle & 0xffffffff);
        e->slots[slot] = NULL;
        e->generations[slot]++;
        rs_work_free(w);
    }
    pthread_mutex_unlock(&e->mu);
}

const char *rs_engine_last_error(rs_engine_t *e) { return e->error.text; }

rs_status_t rs_engine_shutdown(rs_engine_t *e) {
    rs_request_t barrier = {.kind = RS_KIND_BARRIER, .start_now = 1};
    const char *name = SHUTDOWN_NAME;
    int64_t handle;
    rs_status_t st = rs_engine_submit(e, &name, &barrier, 1, &handle);
    int done = 0;
    while (st == RS_OK && !done)
        st = rs_engine_wait(e, handle, 1.0, &done);
    rs_engine_stop_thread(e);
    return st;
}

/* ---- blocking calls on the same-host lane ---- */

/* Joins this rank has completed: the epoch that lane posts carry (see lane.h). */
static uint32_t completed_joins(rs_engine_t *e) {
    return __atomic_load_n(&e->joins, __ATOMIC_ACQUIRE);
}

/* Why this thread's call failed, into the engine's record; returns st. */
static rs_status_t report_text(rs_engine_t *e, rs_status_t st, const char *text) {
    pthread_mutex_lock(&e->mu);
    rs_error_set(&e->error, st, "%s", text);
    pthread_mutex_unlock(&e->mu);
    return st;
}

/* This thread's call was ended by the engine's failure (or a peer's shutdown): its words
 * go into the engine's record; returns its code (st if the engine has not failed). */
static rs_status_t report_failure(rs_engine_t *e, rs_status_t st) {
    pthread_mutex_lock(&e->mu);
    rs_error_copy(&e->error, &e->failure);
    if (e->failure.code != RS_OK)
        st = e->failure.code;
    else if (e->collectives_closed) /* (what stopped a lane caller) */
        st = rs_error_set(&e->error, RS_ERR_COMM, "%s", e->closed_text);
    pthread_mutex_unlock(&e->mu);
    return st;
}

int rs_engine_has_lane(rs_engine_t *e) { return e->lane != NULL; }

static size_t element_count(const rs_meta_t *meta) {
    size_t count = meta->kind == RS_KIND_BARRIER ? 0 : 1;
    for (int d = 0; d < meta->ndim; d++)
        count *= (size_t)meta->shape[d];
    return count;
}

/* A lane call failed with st; why: the lane's record (code RS_OK: nothing of its own). */
static rs_status_t report_lane(rs_engine_t *e, rs_status_t st, const rs_error_t *why) {
    if (st == RS_ERR_COMM || st == RS_ERR_TIMEOUT || st == RS_ERR_SYSTEM) {
        if (why->code != RS_OK)
            rs_engine_fail(e, st, why->text); /* else the engine had failed: it has the words */
        return report_failure(e, st);
    }
    if (why->code != RS_OK)
        return report_text(e, st, why->text);
    rs_error_t comm_why; /* a reduction failed: the communicator's record says why */
    rs_comm_error(e->comm, &comm_why);
    return report_text(e, st, comm_why.text);
}

/* This rank's check of a blocking call failed with st (the engine's record says why):
 * post the refusal in the call's place, so that the peers fail the same call, and wait
 * for them. Returns st with the reason still in the record (or the failure that ended
 * the wait). */
static rs_status_t refuse_on_lane(rs_engine_t *e, rs_lane_t *lane, const char *name,
                                  int kind, rs_status_t st) {
    if (st != RS_ERR_USAGE)
        return st; /* the engine has failed: no call is matched any more */
    char reason[RS_ERROR_LEN];
    snprintf(reason, sizeof reason, "%s", rs_engine_last_error(e));
    rs_error_t why;
    rs_lane_lock(lane);
    rs_status_t waited = rs_lane_refuse(lane, name, kind, reason, &e->lane_stop,
                                        completed_joins(e));
    if (waited != RS_OK)
        rs_error_copy(&why, rs_lane_error(lane));
    rs_lane_unlock(lane);
    return waited != RS_OK ? report_lane(e, waited, &why) : report_text(e, st, reason);
}

rs_status_t rs_engine_refuse(rs_engine_t *e, const char *name, int kind, const char *reason,
                             int blocking) {
    rs_lane_t *lane = e->lane;
    if (!blocking || !lane) {
        refuse_later(e, name, kind, blocking);
        return RS_OK;
    }
    report_text(e, RS_ERR_USAGE, reason ? reason : "");
    rs_status_t st = refuse_on_lane(e, lane, name ? name : "", kind, RS_ERR_USAGE);
    return st == RS_ERR_USAGE ? RS_OK : st;
}

/* A blocking call on the same-host lane (see lane.c). */
rs_status_t rs_engine_try_lane(rs_engine_t *e, const char *name, const rs_request_t *r,
                               int *ran) {
    rs_lane_t *lane = e->lane;
    *ran = 0;
    if (!lane || r->kind == RS_KIND_JOIN || r->kind == RS_KIND_SEND || r->kind == RS_KIND_RECV ||
        r->kind == RS_KIND_TUNE) /* (settings change on the engine thread, in agreed order) */
        return RS_OK;
    rs_status_t st = validate_one(e, name, r);
    if (st != RS_OK) {
        *ran = 1;
        return refuse_on_lane(e, lane, name, r->kind, st);
    }
    rs_meta_t meta = compared_meta(r);
    rs_error_t why; /* read only after a failure */
    double start = rs_now();
    uint64_t flight = rs_flight_begin(&e->flight, name, &meta, RS_ROUTE_LANE, start);
    rs_lane_lock(lane);
    st = rs_lane_run(lane, name, &meta, element_count(&meta), r->sendbuf, r->recvbuf,
                     &e->lane_stop, completed_joins(e), ran);
    if (st != RS_OK)
        rs_error_copy(&why, rs_lane_error(lane)); /* before another thread's call */
    rs_lane_unlock(lane);
    rs_flight_end(&e->flight, flight, *ran ? (int)st : RS_FLIGHT_HANDED_OVER, rs_now());
    rs_timeline_t *timeline = &e->timeline;
    if (*ran && timeline->file)
        rs_timeline_span(timeline, r->kind, name, RS_SPAN_LANE, start, rs_now());
    return st == RS_OK ? RS_OK : report_lane(e, st, &why);
}
