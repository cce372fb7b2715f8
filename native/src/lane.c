/* The same-host fast lane: blocking allreduces without the engine thread.
 *
 * When every rank of a communicator is on one host, a blocking allreduce does not need
 * the engine's negotiation: each caller blocks until all ranks have called it, so ranks
 * must make such calls in the same order anyway (as with MPI). Each rank posts a header
 * (name, dtype, shape, op, scale factors) and, for a small tensor, its data in its own
 * shared segment; once every rank has posted, each checks that the headers agree and
 * reduces all posts in rank order (the same bits on every rank). One exchange through
 * memory, on the calling thread: no thread hand-off, no system call while peers keep up.
 *
 * A tensor larger than the lane posts its header only; every rank then sees the same
 * headers and sends the tensor through the engine, so a size mismatch between ranks is
 * still a clear error instead of a hang.
 *
 * Posts alternate between two slots. A rank posts operation s+2 only after completing
 * s+1, which needs every rank's post s+1, which each made only after completing s: so
 * nobody still reads the slot being overwritten.
 *
 * Waiting spins briefly, then sleeps on a futex in the waiter's own segment; a rank that
 * posts bumps and wakes the futex of every peer that said it sleeps (the same flag
 * handshake as the shm transport's doorbells). Asleep, a waiter looks every few
 * milliseconds at the engine's failure, its peers' sockets (death, abort), and the stall
 * and timeout deadlines. A rank that has joined takes part with zeros (submit.c calls
 * rs_lane_serve_joined while it waits for the join).
 *
 * The same slots carry the staged allreduce (bottom of this file), a reduce-scatter
 * through shared memory in cache-sized chunks: the lane runs it for blocking allreduces
 * above the one-round size, and the engine's executor, on an instance of its own (its own
 * area of the segment), for large allreduces that negotiation has ordered. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "algorithms.h"
#include "lane.h"
#include "negotiate.h" /* rs_check_agreement: the engine's words for a disagreement */
#include "reduce.h"
#include "transport.h"
#include "util.h"

#define SLICE_SECONDS 0.005      /* how often a sleeping waiter looks at failures */
#define LOST_PEER_WAIT_SECONDS 0.5 /* after an abort notice, wait this long for a hangup */

/* What a post announces: its data follows (one round); the engine runs the call; the
 * allreduce goes in staged chunks after the headers agree. */
enum { POST_DATA = 1, POST_USE_ENGINE = 2, POST_STAGED = 4, POST_REFUSED = 8 };
#define REFUSAL_TEXT_MAX 900 /* bytes of a refusal's reason a peer quotes */

typedef struct {
    uint64_t seq; /* stored last, with release: the post for operation `seq` is complete */
    char pad0[56];
    uint64_t reduced; /* staged allreduce: this rank's slice of chunk `reduced` is ready */
    char pad1[56];
    uint64_t name_hash;
    int32_t flags;
    uint32_t epoch; /* joins the poster had completed: a joined rank serves its own epoch */
    uint64_t bytes;
    rs_meta_t meta;
    char name[RS_MAX_NAME_LEN + 1]; /* whole: the hash only rules out a match quickly */
    char data[RS_LANE_MAX_BYTES] __attribute__((aligned(64)));
} post_t;

typedef struct {
    uint32_t bell;    /* futex word: bumped by a peer that posted while we slept */
    int32_t sleeping; /* we block on `bell`: posters must bump it */
    char pad[120];
    post_t posts[2];
} area_t;

_Static_assert(sizeof(area_t) <= RS_LANE_AREA_BYTES, "the lane outgrew its shared area");

struct rs_lane {
    rs_comm_t *comm;
    area_t **areas; /* per rank, this rank's included */
    uint64_t seq;   /* operations this rank has posted */
    double spin_seconds;
    double stall_seconds;
    size_t max_bytes; /* larger tensors go through the engine */
    /* One operation at a time per rank. The caller of rs_lane_run holds it (until it
     * has read `error`); a joined rank's wait takes it for each slice. The executor's
     * staged instance needs none: only the engine thread uses it. */
    pthread_mutex_t mu;
    rs_error_t error; /* why the last operation failed: written by the thread holding mu */
    uint32_t serving; /* a joined rank's wait: the epoch it serves (under mu) */
    uint64_t stalls;  /* stall reports made (atomic: the engine thread reads it) */
    /* The named call this rank blocks in, for a hang report (under info_mu: the caller
     * that waits writes it, the engine thread reads it). waiting_seq 0: none. */
    pthread_mutex_t info_mu;
    char waiting_name[RS_MAX_NAME_LEN + 1];
    int waiting_kind;
    uint64_t waiting_seq;
    double waiting_since;
};

rs_lane_t *rs_lane_create(rs_comm_t *comm, int area, double spin_seconds,
                          double stall_seconds, size_t max_bytes) {
    if (comm->size < 2 || !comm->transport->shared_area(comm, comm->rank, area))
        return NULL;
    rs_lane_t *lane = calloc(1, sizeof *lane);
    if (!lane || !(lane->areas = calloc((size_t)comm->size, sizeof *lane->areas))) {
        free(lane);
        return NULL;
    }
    for (int r = 0; r < comm->size; r++)
        lane->areas[r] = comm->transport->shared_area(comm, r, area);
    lane->comm = comm;
    lane->spin_seconds = spin_seconds;
    lane->stall_seconds = stall_seconds;
    lane->max_bytes = max_bytes;
    pthread_mutex_init(&lane->mu, NULL);
    pthread_mutex_init(&lane->info_mu, NULL);
    return lane;
}

uint64_t rs_lane_stalls(const rs_lane_t *lane) {
    return __atomic_load_n(&lane->stalls, __ATOMIC_ACQUIRE);
}

void rs_lane_lock(rs_lane_t *lane) { pthread_mutex_lock(&lane->mu); }
void rs_lane_unlock(rs_lane_t *lane) { pthread_mutex_unlock(&lane->mu); }
const rs_error_t *rs_lane_error(const rs_lane_t *lane) { return &lane->error; }

void rs_lane_free(rs_lane_t *lane) {
    if (!lane)
        return;
    pthread_mutex_destroy(&lane->mu);
    pthread_mutex_destroy(&lane->info_mu);
    free(lane->areas);
    free(lane);
}

/* ---- posting and waking ---- */

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

static int posted(const rs_lane_t *lane, int rank, uint64_t seq) {
    return __atomic_load_n(&lane->areas[rank]->posts[seq & 1].seq, __ATOMIC_ACQUIRE) == seq;
}

static int all_reduced(const rs_lane_t *lane, uint64_t seq) {
    for (int r = 0; r < lane->comm->size; r++)
        if (__atomic_load_n(&lane->areas[r]->posts[seq & 1].reduced, __ATOMIC_ACQUIRE) != seq)
            return 0;
    return 1;
}

static int all_posted(const rs_lane_t *lane, uint64_t seq) {
    for (int r = 0; r < lane->comm->size; r++)
        if (!posted(lane, r, seq))
            return 0;
    return 1;
}

static void publish(rs_lane_t *lane, uint64_t *counter, uint64_t seq) {
    __atomic_store_n(counter, seq, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* pairs with the sleeper's flag-then-check */
    for (int r = 0; r < lane->comm->size; r++) {
        area_t *a = lane->areas[r];
        if (r == lane->comm->rank || !__atomic_load_n(&a->sleeping, __ATOMIC_RELAXED))
            continue;
        __atomic_add_fetch(&a->bell, 1, __ATOMIC_RELEASE);
        futex(&a->bell, FUTEX_WAKE, INT_MAX, NULL);
    }
}

/* Sleep on our bell until a peer posts (or `seconds` pass); `ready` is checked after the
 * sleeping flag is up, so a post in between is never missed. */
static void doze(rs_lane_t *lane, double seconds, int (*ready)(const rs_lane_t *, uint64_t),
                 uint64_t seq) {
    area_t *mine = lane->areas[lane->comm->rank];
    uint32_t bell = __atomic_load_n(&mine->bell, __ATOMIC_ACQUIRE);
    __atomic_store_n(&mine->sleeping, 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!ready(lane, seq) && seconds > 0) {
        struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
        futex(&mine->bell, FUTEX_WAIT, bell, &ts);
    }
    __atomic_store_n(&mine->sleeping, 0, __ATOMIC_RELAXED);
}

/* ---- waiting for every rank's post ---- */

static void missing_ranks(const rs_lane_t *lane, uint64_t seq, int want, char *out, size_t cap) {
    unsigned char *flags = malloc((size_t)(unsigned)lane->comm->size);
    if (!flags) {
        snprintf(out, cap, "[?]");
        return;
    }
    for (int r = 0; r < lane->comm->size; r++)
        flags[r] = (unsigned char)posted(lane, r, seq);
    rs_format_ranks(flags, lane->comm->size, want, out, cap);
    free(flags);
}

/* A dead peer is named in preference to one that aborted because of it. */
typedef struct {
    const char *name; /* the lane's tensor (stall report, timeout); NULL: a staged allreduce */
    int kind;
    const rs_status_t *failure; /* the engine's, or NULL */
} waiting_t;

static rs_status_t peer_gone(rs_lane_t *lane, int peer, int aborted) {
    char text[RS_ERROR_LEN];
    if (!aborted)
        rs_note_lost(lane->comm, peer);
    rs_peer_gone_text(lane->comm, peer, aborted, -1, text, sizeof text);
    return rs_error_set(&lane->error, RS_ERR_COMM, "%s", text);
}

static rs_status_t check_peers(rs_lane_t *lane, double *abort_seen) {
    rs_comm_t *comm = lane->comm;
    int aborted = -1;
    for (int p = 0; p < comm->size; p++) {
        if (p == comm->rank)
            continue;
        int state = comm->transport->peer_state(comm, p);
        if (state == RS_PEER_LOST)
            return peer_gone(lane, p, 0);
        if (state == RS_PEER_ABORTED && aborted < 0)
            aborted = p;
    }
    if (aborted < 0)
        return RS_OK;
    if (*abort_seen == 0)
        *abort_seen = rs_now();
    if (rs_now() - *abort_seen < LOST_PEER_WAIT_SECONDS)
        return RS_OK;
    return peer_gone(lane, aborted, 1);
}

static void report_stall(rs_lane_t *lane, uint64_t seq, const char *name, int kind,
                         double waited) {
    __atomic_add_fetch(&lane->stalls, 1, __ATOMIC_RELEASE);
    char have[512], missing[512];
    missing_ranks(lane, seq, 1, have, sizeof have);
    missing_ranks(lane, seq, 0, missing, sizeof missing);
    rs_report_stall(name, kind, have, missing, waited);
}

static rs_status_t time_out(rs_lane_t *lane, uint64_t seq, const waiting_t *w, double waited) {
    if (!w->name)
        return rs_error_set(&lane->error, RS_ERR_TIMEOUT, "rank %d: timed out after %.1f s in a "
                            "shared-memory allreduce waiting for its peers "
                            "(RINGSYNC_TIMEOUT_SECONDS=%g)", lane->comm->rank, waited,
                            lane->comm->timeout_seconds);
    char missing[512], text[RS_ERROR_LEN];
    missing_ranks(lane, seq, 0, missing, sizeof missing);
    rs_submit_timeout_text(lane->comm, w->name, w->kind, waited, missing, text, sizeof text);
    return rs_error_set(&lane->error, RS_ERR_TIMEOUT, "%s", text);
}

/* Why a wait cannot go on (RS_OK: it can): the engine failed or was aborted (it has the
 * words), the communicator is broken, or a peer is gone. */
static rs_status_t wait_blocked(rs_lane_t *lane, const waiting_t *w, double *abort_seen) {
    rs_status_t failed = w->failure ? __atomic_load_n(w->failure, __ATOMIC_ACQUIRE) : RS_OK;
    if (failed)
        return failed;
    if (__atomic_load_n(&lane->comm->broken, __ATOMIC_RELAXED))
        return rs_error_set(&lane->error, RS_ERR_COMM, "rank %d: communicator is broken by an "
                            "earlier failure", lane->comm->rank);
    return check_peers(lane, abort_seen);
}

/* What this rank blocks in (name NULL: nothing), for rs_lane_waiting. */
static void note_waiting(rs_lane_t *lane, const waiting_t *w, uint64_t seq, double since) {
    pthread_mutex_lock(&lane->info_mu);
    lane->waiting_seq = w ? seq : 0;
    if (w) {
        snprintf(lane->waiting_name, sizeof lane->waiting_name, "%s", w->name);
        lane->waiting_kind = w->kind;
        lane->waiting_since = since;
    }
    pthread_mutex_unlock(&lane->info_mu);
}

int rs_lane_waiting(rs_lane_t *lane, char *name, size_t cap, int *kind, double *since,
                    unsigned char *posted_by) {
    pthread_mutex_lock(&lane->info_mu);
    uint64_t seq = lane->waiting_seq;
    if (seq) {
        snprintf(name, cap, "%s", lane->waiting_name);
        *kind = lane->waiting_kind;
        *since = lane->waiting_since;
        for (int r = 0; r < lane->comm->size; r++)
            posted_by[r] = (unsigned char)posted(lane, r, seq);
    }
    pthread_mutex_unlock(&lane->info_mu);
    return seq != 0;
}

static rs_status_t wait_slices(rs_lane_t *lane, int (*ready)(const rs_lane_t *, uint64_t),
                               uint64_t seq, const waiting_t *w, double start);

/* Spin, then sleep in slices until ready(lane, seq) (see wait_slices). A named call that
 * must sleep says so for a hang report while it does. */
static rs_status_t wait_for(rs_lane_t *lane, int (*ready)(const rs_lane_t *, uint64_t),
                            uint64_t seq, const waiting_t *w) {
    /* (peers that keep up have posted by now, or within a few looks: the clock costs more
     * than a look, so it is read only for a wait that lasts) */
    for (int look = 0; look < 64; look++)
        if (ready(lane, seq))
            return RS_OK;
    double start = rs_now(), spin_until = start + lane->spin_seconds;
    while (!ready(lane, seq))
        if (rs_now() >= spin_until) {
            if (w->name)
                note_waiting(lane, w, seq, start);
            rs_status_t st = wait_slices(lane, ready, seq, w, start);
            if (w->name)
                note_waiting(lane, NULL, 0, 0);
            return st;
        }
    return RS_OK;
}

/* While this rank waits for operation seq, a peer's word for it (its sequence word, or in a
 * staged allreduce its `reduced` word) holds seq, an earlier operation of the same slot, or
 * 0 before the slot's first use: a peer writes operation seq + 2 there only after it has
 * completed seq + 1, which needs this rank's post of seq + 1, made after this rank completes
 * seq. (Not so the slot's other word: a peer stages chunk seq + 2 while this rank still
 * waits for the slices of chunk seq to be reduced.) Any other value was forged, or the
 * peer's memory corrupted; waiting for it would last until the timeout, or forever. */
static rs_status_t check_words(rs_lane_t *lane, int (*ready)(const rs_lane_t *, uint64_t),
                               uint64_t seq) {
    int reduced = ready == all_reduced; /* (else all_posted) */
    for (int r = 0; r < lane->comm->size; r++) {
        const post_t *p = &lane->areas[r]->posts[seq & 1];
        uint64_t word = __atomic_load_n(reduced ? &p->reduced : &p->seq, __ATOMIC_ACQUIRE);
        if (r != lane->comm->rank && (word > seq || (word != 0 && (word & 1) != (seq & 1))))
            return rs_error_set(&lane->error, RS_ERR_COMM, "rank %d: rank %d's %s word on the "
                                "shared-memory lane says operation %llu where this rank waits "
                                "for operation %llu: rank %d wrote it, or corrupted its memory; "
                                "the communicator is broken", lane->comm->rank, r,
                                reduced ? "reduced" : "sequence", (unsigned long long)word,
                                (unsigned long long)seq, r);
    }
    return RS_OK;
}

/* Sleep in slices until ready(lane, seq); between slices, look at the engine's failure,
 * the communicator, the peers' sockets, their words for seq (check_words), and the stall
 * and timeout deadlines. */
static rs_status_t wait_slices(rs_lane_t *lane, int (*ready)(const rs_lane_t *, uint64_t),
                               uint64_t seq, const waiting_t *w, double start) {
    double abort_seen = 0;
    int stall_reported = !w->name || lane->comm->rank != 0 || lane->stall_seconds <= 0;
    while (!ready(lane, seq)) {
        double now = rs_now();
        rs_status_t blocked = wait_blocked(lane, w, &abort_seen);
        if (blocked != RS_OK) /* A peer may have posted, finished the call and then shut
                               * down (or died) since `ready` was read: what it posted
                               * still completes this call here. */
            return ready(lane, seq) ? RS_OK : blocked;
        RS_CHECK(check_words(lane, ready, seq));
        if (!stall_reported && now - start >= lane->stall_seconds) {
            report_stall(lane, seq, w->name, w->kind, now - start);
            stall_reported = 1;
        }
        if (lane->comm->timeout_seconds > 0 && now - start >= lane->comm->timeout_seconds)
            return time_out(lane, seq, w, now - start);
        doze(lane, SLICE_SECONDS, ready, seq);
    }
    return RS_OK;
}

/* ---- one operation ---- */

/* Every post's flags and metadata, read once: a peer may rewrite its post while this rank
 * checks it, so what is checked is what is used (a second read could, say, find ndim 9
 * where the first found 1, and format dimensions past the shape). */
#define SNAPSHOT_ON_STACK 8 /* ranks whose posts are read without an allocation */
typedef struct {
    rs_meta_t *metas; /* per rank */
    int32_t *flags;
    rs_meta_t stack_metas[SNAPSHOT_ON_STACK];
    int32_t stack_flags[SNAPSHOT_ON_STACK];
} snapshot_t;

static int take_snapshot(const rs_lane_t *lane, uint64_t seq, snapshot_t *s) {
    size_t ranks = (size_t)(unsigned)lane->comm->size; /* (at least two: the lane needs a peer) */
    int small = ranks <= SNAPSHOT_ON_STACK;
    s->metas = small ? s->stack_metas : calloc(ranks, sizeof *s->metas);
    s->flags = small ? s->stack_flags : calloc(ranks, sizeof *s->flags);
    if (!s->metas || !s->flags)
        return 0;
    for (int r = 0; r < lane->comm->size; r++) {
        const post_t *p = &lane->areas[r]->posts[seq & 1];
        memcpy(&s->metas[r], &p->meta, sizeof s->metas[r]);
        s->flags[r] = __atomic_load_n(&p->flags, __ATOMIC_RELAXED);
    }
    return 1;
}

static void free_snapshot(snapshot_t *s) {
    if (s->metas != s->stack_metas)
        free(s->metas);
    if (s->flags != s->stack_flags)
        free(s->flags);
}

/* A post no honest rank makes: the peer wrote it, or corrupted its memory. As a malformed
 * negotiation message does (negotiate.c), it breaks the communicator, naming the peer. */
static rs_status_t malformed_post(rs_lane_t *lane, int r, const char *why) {
    return rs_error_set(&lane->error, RS_ERR_COMM, "rank %d: malformed post on the "
                        "shared-memory lane from rank %d (%s); the communicator is broken",
                        lane->comm->rank, r, why);
}

/* A peer's post is read as untrusted: its flags must be one that post_flags or a refusal
 * gives, and its metadata well formed (submit.c checks a rank's own before it posts), before
 * anything formats or sizes from them (every rank reads the same posts and finds the same). */
static rs_status_t check_well_formed(rs_lane_t *lane, const snapshot_t *s) {
    rs_error_t why;
    for (int r = 0; r < lane->comm->size; r++) {
        int32_t f = s->flags[r];
        if (f != POST_DATA && f != POST_USE_ENGINE && f != POST_STAGED && f != POST_REFUSED) {
            snprintf(why.text, sizeof why.text, "flags %d", (int)f);
            return malformed_post(lane, r, why.text);
        }
        if (rs_meta_check(&s->metas[r], lane->comm->size, &why, NULL, NULL) != RS_OK)
            return malformed_post(lane, r, why.text);
    }
    return RS_OK;
}

static rs_status_t check_names(rs_lane_t *lane, uint64_t seq, const snapshot_t *s) {
    const post_t *first = &lane->areas[0]->posts[seq & 1];
    for (int r = 1; r < lane->comm->size; r++) {
        const post_t *p = &lane->areas[r]->posts[seq & 1];
        if (p->name_hash != first->name_hash ||
            strncmp(p->name, first->name, sizeof p->name) != 0)
            return rs_error_set(&lane->error, RS_ERR_USAGE, "Mismatched blocking collectives: "
                                "rank 0 called %s '%.*s', rank %d called %s '%.*s' (every rank "
                                "must make blocking collectives in the same order)",
                                rs_kind_name(s->metas[0].kind), RS_MAX_NAME_LEN, first->name, r,
                                rs_kind_name(s->metas[r].kind), RS_MAX_NAME_LEN, p->name);
    }
    return RS_OK;
}

/* The engine's agreement check (the same words as for its own requests). */
static rs_status_t check_metas(rs_lane_t *lane, uint64_t seq, const snapshot_t *s) {
    int size = lane->comm->size;
    unsigned char on_stack[SNAPSHOT_ON_STACK];
    unsigned char *submitted = size <= SNAPSHOT_ON_STACK ? on_stack : malloc((size_t)size);
    if (!submitted)
        return rs_error_set(&lane->error, RS_ERR_USAGE, "rank %d: out of memory",
                            lane->comm->rank);
    memset(submitted, 1, (size_t)(unsigned)size);
    char name[RS_MAX_NAME_LEN + 1];
    const char *posted_name = lane->areas[0]->posts[seq & 1].name;
    size_t len = strnlen(posted_name, RS_MAX_NAME_LEN); /* (rank 0's memory: bounded) */
    memcpy(name, posted_name, len);
    name[len] = '\0';
    rs_pending_t p = {.name = name, .metas = s->metas, .submitted = submitted, .count = size};
    char *message = rs_check_agreement(&p, size);
    rs_status_t st = RS_OK;
    if (message)
        st = rs_error_set(&lane->error, RS_ERR_USAGE, "%s", message);
    free(message);
    if (submitted != on_stack)
        free(submitted);
    return st;
}

/* A rank that refused the call (rs_lane_refuse) fails it on every rank: the first such
 * rank is named with its reason (its own bytes: at most REFUSAL_TEXT_MAX of them, up to a
 * NUL, are quoted). */
static rs_status_t check_refusals(rs_lane_t *lane, uint64_t seq, const snapshot_t *s) {
    for (int r = 0; r < lane->comm->size; r++) {
        const post_t *p = &lane->areas[r]->posts[seq & 1];
        if (s->flags[r] != POST_REFUSED)
            continue;
        const char *end = memchr(p->data, '\0', REFUSAL_TEXT_MAX);
        int len = end ? (int)(end - p->data) : REFUSAL_TEXT_MAX;
        return rs_error_set(&lane->error, RS_ERR_USAGE, "blocking %s '%.*s' was refused on rank "
                            "%d: %.*s", rs_kind_name(s->metas[r].root), 200, p->name, r,
                            len, p->data);
    }
    return RS_OK;
}

/* RS_OK if every rank posted the same well-formed tensor; else RS_ERR_COMM for a malformed
 * post, RS_ERR_USAGE for a disagreement, with the lane's record naming ranks and values. */
static rs_status_t check_posts(rs_lane_t *lane, uint64_t seq) {
    snapshot_t s;
    rs_status_t st = RS_OK;
    if (!take_snapshot(lane, seq, &s))
        st = rs_error_set(&lane->error, RS_ERR_USAGE, "rank %d: out of memory",
                          lane->comm->rank);
    if (st == RS_OK)
        st = check_well_formed(lane, &s);
    if (st == RS_OK)
        st = check_refusals(lane, seq, &s);
    if (st == RS_OK)
        st = check_names(lane, seq, &s);
    if (st == RS_OK)
        st = check_metas(lane, seq, &s);
    free_snapshot(&s);
    return st;
}

static rs_status_t reduce_posts(rs_lane_t *lane, uint64_t seq, const rs_meta_t *meta,
                                size_t count, void *recvbuf) {
    size_t bytes = count * rs_dtype_size(meta->dtype);
    rs_reduce_fn reduce = rs_reduce_kernel(meta->dtype, meta->op);
    memcpy(recvbuf, lane->areas[0]->posts[seq & 1].data, bytes);
    for (int r = 1; r < lane->comm->size; r++)
        reduce(recvbuf, lane->areas[r]->posts[seq & 1].data, count);
    return rs_finish_scale(lane->comm, recvbuf, count, meta->dtype, meta->op, meta->postscale);
}

static void fill_header(post_t *post, const char *name, const rs_meta_t *meta, size_t bytes,
                        int flags, uint32_t epoch) {
    post->epoch = epoch;
    size_t len = strnlen(name, RS_MAX_NAME_LEN); /* (not snprintf: this is every call's path) */
    memcpy(post->name, name, len);
    post->name[len] = '\0';
    post->name_hash = rs_fnv1a(post->name, len);
    post->meta = *meta;
    post->bytes = bytes;
    post->flags = flags;
}

static int post_flags(const rs_lane_t *lane, const rs_meta_t *meta, size_t bytes) {
    if (meta->kind == RS_KIND_BARRIER)
        return POST_DATA; /* no data: the exchange is the barrier */
    /* Adasum is no sum of posts: only the engine's algorithm computes it */
    if (meta->kind != RS_KIND_ALLREDUCE || meta->op == RS_OP_ADASUM || bytes > lane->max_bytes)
        return POST_USE_ENGINE;
    /* (atomic: autotune's tune request changes it on the engine thread; ranks that read
     * different values post different flags, and agreed_flags sends the call to the engine) */
    size_t small = __atomic_load_n(&lane->comm->small_allreduce_bytes, __ATOMIC_RELAXED);
    size_t one_round = small < RS_LANE_MAX_BYTES ? small : RS_LANE_MAX_BYTES;
    return bytes <= one_round ? POST_DATA : POST_STAGED;
}

/* How every rank runs the call, from all the posts' flags (the same on every rank). */
static int agreed_flags(const rs_lane_t *lane, uint64_t seq) {
    int all = ~0, any = 0;
    for (int r = 0; r < lane->comm->size; r++) {
        all &= lane->areas[r]->posts[seq & 1].flags;
        any |= lane->areas[r]->posts[seq & 1].flags;
    }
    return (any & POST_USE_ENGINE) || all != any ? POST_USE_ENGINE : all;
}

static rs_status_t staged_allreduce(rs_lane_t *lane, const void *sendbuf, void *recvbuf,
                                    size_t count, const rs_meta_t *meta, const waiting_t *w);

rs_status_t rs_lane_run(rs_lane_t *lane, const char *name, const rs_meta_t *meta,
                        size_t count, const void *sendbuf, void *recvbuf,
                        const rs_status_t *failure, uint32_t epoch, int *ran) {
    size_t bytes = count * rs_dtype_size(meta->dtype);
    int flags = post_flags(lane, meta, bytes);
    rs_error_clear(&lane->error);
    uint64_t seq = ++lane->seq;
    post_t *post = &lane->areas[lane->comm->rank]->posts[seq & 1];
    fill_header(post, name, meta, bytes, flags, epoch);
    rs_status_t scaled = RS_OK;
    if ((flags & POST_DATA) && bytes) {
        memcpy(post->data, sendbuf, bytes);
        if (meta->prescale != 1.0)
            scaled = rs_scale(lane->comm, post->data, count, meta->dtype, meta->prescale);
    }
    publish(lane, &post->seq, seq); /* even after a failed prescale: the peers must not hang */
    waiting_t w = {name, meta->kind, failure};
    *ran = 1; /* a failure is this call's: the engine must not run it again */
    RS_CHECK(wait_for(lane, all_posted, seq, &w));
    RS_CHECK(scaled);
    RS_CHECK(check_posts(lane, seq));
    int agreed = agreed_flags(lane, seq);
    *ran = !(agreed & POST_USE_ENGINE);
    if ((agreed & POST_DATA) && count && meta->kind == RS_KIND_ALLREDUCE)
        return reduce_posts(lane, seq, meta, count, recvbuf);
    if (agreed & POST_STAGED)
        return staged_allreduce(lane, sendbuf, recvbuf, count, meta, &w);
    return RS_OK;
}

rs_status_t rs_lane_refuse(rs_lane_t *lane, const char *name, int kind, const char *reason,
                           const rs_status_t *failure, uint32_t epoch) {
    rs_error_clear(&lane->error);
    uint64_t seq = ++lane->seq;
    post_t *post = &lane->areas[lane->comm->rank]->posts[seq & 1];
    rs_meta_t meta = rs_refusal_meta(kind);
    size_t len = strnlen(reason, REFUSAL_TEXT_MAX - 1);
    fill_header(post, name, &meta, len + 1, POST_REFUSED, epoch);
    memcpy(post->data, reason, len);
    post->data[len] = '\0';
    publish(lane, &post->seq, seq);
    /* Wait like every rank: its post of this call may be overwritten only after that. */
    waiting_t w = {name, kind, failure};
    return wait_for(lane, all_posted, seq, &w);
}

/* ---- a joined rank ---- */

/* A peer's post for operation seq made during the join this rank serves (d->serving).
 * A post from a later epoch was made after the join completed on its poster: it belongs
 * to this rank's own next call, which the join's completion here will soon allow. */
static int posted_in_epoch(const rs_lane_t *lane, int rank, uint64_t seq) {
    return posted(lane, rank, seq) &&
           __atomic_load_n(&lane->areas[rank]->posts[seq & 1].epoch, __ATOMIC_RELAXED) ==
               lane->serving;
}

static int next_posted_by_any(const rs_lane_t *lane, uint64_t seq) {
    for (int r = 0; r < lane->comm->size; r++)
        if (r != lane->comm->rank && posted_in_epoch(lane, r, seq))
            return 1;
    return 0;
}

/* A joined rank's part in a staged allreduce: zeros in, the result dropped. Like the
 * callers, it first waits for every header: its slots may be reused only once every rank
 * has read its previous posts. A failure is left for the callers, and for the engine, to
 * report. */
static void stage_zeros(rs_lane_t *lane, const rs_meta_t *meta, size_t bytes) {
    char *zeros = calloc(1, bytes), *out = malloc(bytes);
    waiting_t w = {"(joined)", RS_KIND_ALLREDUCE, NULL};
    if (zeros && out && wait_for(lane, all_posted, lane->seq, &w) == RS_OK)
        staged_allreduce(lane, zeros, out, bytes / rs_dtype_size(meta->dtype), meta, &w);
    free(zeros);
    free(out);
}

/* Under the lane's lock: post for every operation the others have posted. */
static void serve_posts(rs_lane_t *lane) {
    for (;;) {
        uint64_t seq = lane->seq + 1;
        int from = -1;
        for (int r = 0; r < lane->comm->size && from < 0; r++)
            if (r != lane->comm->rank && posted_in_epoch(lane, r, seq))
                from = r;
        if (from < 0)
            return;
        const post_t *theirs = &lane->areas[from]->posts[seq & 1];
        post_t *mine = &lane->areas[lane->comm->rank]->posts[seq & 1];
        /* Only allreduce works with join: the engine fails the others on every rank. A
         * post whose size does not follow from its (well-formed) metadata goes there too. */
        rs_meta_t meta = theirs->meta; /* one read of the peer's fields */
        int64_t bytes = 0;
        rs_error_t why; /* (the engine words the error, on every rank) */
        int flags = meta.kind == RS_KIND_ALLREDUCE && !(theirs->flags & POST_REFUSED)
                        ? theirs->flags : POST_USE_ENGINE;
        if (rs_meta_check(&meta, lane->comm->size, &why, NULL, &bytes) != RS_OK ||
            ((flags & POST_DATA) && (size_t)bytes > RS_LANE_MAX_BYTES))
            flags = POST_USE_ENGINE;
        fill_header(mine, theirs->name, &meta, (size_t)bytes, flags, lane->serving);
        if (flags & POST_DATA)
            memset(mine->data, 0, (size_t)bytes);
        publish(lane, &mine->seq, seq);
        lane->seq = seq;
        if (flags & POST_STAGED)
            stage_zeros(lane, &meta, (size_t)bytes);
    }
}

void rs_lane_serve_joined(rs_lane_t *lane, const int *done, uint32_t epoch, double until) {
    for (double now = rs_now(); !__atomic_load_n(done, __ATOMIC_ACQUIRE) && now < until;
         now = rs_now()) {
        pthread_mutex_lock(&lane->mu); /* a slice at a time: other callers get their turn */
        lane->serving = epoch;
        serve_posts(lane);
        double left = until - now;
        doze(lane, left < SLICE_SECONDS ? left : SLICE_SECONDS, next_posted_by_any, lane->seq + 1);
        pthread_mutex_unlock(&lane->mu);
    }
}

/* ---- the staged allreduce: a reduce-scatter through shared memory ---- */

/* Chunks small enough that the staging slots stay in cache while every rank reads them. */
#define STAGE_CHUNK_BYTES ((size_t)256 << 10)
_Static_assert(STAGE_CHUNK_BYTES <= RS_LANE_MAX_BYTES, "a staged chunk fits a post");

typedef struct {
    rs_dtype_t dtype;
    rs_op_t op;
    double prescale, postscale;
    size_t elem;
    rs_reduce_fn reduce;
} reduction_t;

/* Copy `n` elements into the staging slot at the same offset, scaled as the reduction says. */
static rs_status_t stage(rs_comm_t *comm, char *slot, const char *send, size_t lo, size_t n,
                         const reduction_t *red) {
    char *at = slot + lo * red->elem;
    memcpy(at, send + lo * red->elem, n * red->elem);
    return red->prescale == 1.0 ? RS_OK : rs_scale(comm, at, n, red->dtype, red->prescale);
}

/* One chunk of the staged allreduce: `count` elements at `send` and `recv`, posted as
 * operation `seq` (slot seq & 1). Rank r owns slice r (rs_even_part of the chunk). */
typedef struct {
    const char *send;
    char *recv;
    size_t count;
    uint64_t seq;
} chunk_t;

static char *my_slot(const rs_lane_t *lane, uint64_t seq) {
    return lane->areas[lane->comm->rank]->posts[seq & 1].data;
}

/* Step 1: copy the slices that the peers own into my slot, then post the chunk. */
static rs_status_t stage_chunk(rs_lane_t *lane, const chunk_t *c, const reduction_t *red) {
    size_t lo, n;
    rs_even_part(c->count, lane->comm->size, lane->comm->rank, &lo, &n);
    RS_CHECK(stage(lane->comm, my_slot(lane, c->seq), c->send, 0, lo, red));
    RS_CHECK(stage(lane->comm, my_slot(lane, c->seq), c->send, lo + n, c->count - lo - n,
                   red));
    lane->seq = c->seq;
    publish(lane, &lane->areas[lane->comm->rank]->posts[c->seq & 1].seq, c->seq);
    return RS_OK;
}

/* Step 2: reduce my slice of every rank's post into my output, in rank order (rank 0's
 * data first, as every other allreduce folds: an element's bits then never depend on
 * which slice or chunk it fell in, nor on whether it was staged), put the result in my
 * slot and say so. Each slice has one owner, so every rank ends with the owner's bits.
 * My own data (prescaled, as the peers' posts are) goes into my slot's slice too, which
 * is free once every rank has posted this chunk (see stage_next_and_wait), so that each
 * rank's part is read from its slot. */
static rs_status_t reduce_my_slice(rs_lane_t *lane, const chunk_t *c, const reduction_t *red,
                                   const waiting_t *w) {
    int me = lane->comm->rank;
    size_t lo, n;
    rs_even_part(c->count, lane->comm->size, me, &lo, &n);
    char *out = c->recv + lo * red->elem;
    RS_CHECK(wait_for(lane, all_posted, c->seq, w));
    RS_CHECK(stage(lane->comm, my_slot(lane, c->seq), c->send, lo, n, red));
    memcpy(out, lane->areas[0]->posts[c->seq & 1].data + lo * red->elem, n * red->elem);
    for (int r = 1; r < lane->comm->size; r++)
        red->reduce(out, lane->areas[r]->posts[c->seq & 1].data + lo * red->elem, n);
    RS_CHECK(rs_finish_scale(lane->comm, out, n, red->dtype, red->op, red->postscale));
    memcpy(my_slot(lane, c->seq) + lo * red->elem, out, n * red->elem);
    publish(lane, &lane->areas[me]->posts[c->seq & 1].reduced, c->seq);
    return RS_OK;
}

/* Step 3 (once every rank has reduced its slice): copy the other slices out of their
 * owners' slots. */
static void copy_reduced(rs_lane_t *lane, const chunk_t *c, const reduction_t *red) {
    for (int r = 0; r < lane->comm->size; r++) {
        if (r == lane->comm->rank)
            continue;
        size_t lo, n;
        rs_even_part(c->count, lane->comm->size, r, &lo, &n);
        memcpy(c->recv + lo * red->elem, lane->areas[r]->posts[c->seq & 1].data + lo * red->elem,
               n * red->elem);
    }
}

static chunk_t nth_chunk(const void *sendbuf, void *recvbuf, size_t count, size_t per_chunk,
                         const reduction_t *red, uint64_t first_seq, size_t k) {
    size_t at = k * per_chunk;
    chunk_t c = {(const char *)sendbuf + at * red->elem, (char *)recvbuf + at * red->elem,
                 count - at < per_chunk ? count - at : per_chunk, first_seq + k};
    return c;
}

/* Stage `next` (NULL: none) and wait until every rank has reduced its slice of `c`.
 *
 * Chunk k+1 is staged while chunk k finishes: right after my slice of chunk k is reduced,
 * before waiting for the others' slices of it. Each byte crosses between ranks once each
 * way; the waits per chunk stay two, but a rank's copy-out of chunk k now overlaps its
 * peers' work on chunk k+1.
 *
 * Why staging chunk k+1 early overwrites nothing still read. It goes into my slot
 * (k+1) & 1, last used by chunk k-1 (or, for k = 0, by an earlier operation, which every
 * rank finished before posting chunk 0). Of chunk k-1 in that slot, peers read (a) the
 * slices they own, to reduce them, and (b) my reduced slice, to copy it out. Before
 * staging, I have waited for every rank's post of chunk k, which each makes after
 * reducing chunk k-1: (a) is over. (b) may still run: a peer copies chunk k-1 out only
 * after posting chunk k. But staging writes only the slices the peers own, never mine;
 * this holds while chunk k+1 is cut into the same slices as chunk k-1, i.e. while it is
 * a full chunk. The last, shorter chunk is cut differently, so it is staged only after
 * every rank has reduced its slice of chunk k (which each does after copying out chunk
 * k-1). My own data of my slice of chunk k+1, then its reduction, go into that slot once
 * every rank has posted chunk k+1, after its copy-out of chunk k-1. The `seq` and `reduced`
 * words follow the same order: nobody still waits for the values they replace. */
static rs_status_t stage_next_and_wait(rs_lane_t *lane, const chunk_t *c, const chunk_t *next,
                                       int early, const reduction_t *red, const waiting_t *w) {
    if (next && early)
        RS_CHECK(stage_chunk(lane, next, red));
    RS_CHECK(wait_for(lane, all_reduced, c->seq, w));
    if (next && !early)
        RS_CHECK(stage_chunk(lane, next, red));
    return RS_OK;
}

static rs_status_t staged_allreduce(rs_lane_t *lane, const void *sendbuf, void *recvbuf,
                                    size_t count, const rs_meta_t *meta, const waiting_t *w) {
    reduction_t red = {meta->dtype, meta->op, meta->prescale, meta->postscale,
                       rs_dtype_size(meta->dtype), rs_reduce_kernel(meta->dtype, meta->op)};
    size_t per_chunk = STAGE_CHUNK_BYTES / red.elem;
    size_t chunks = (count + per_chunk - 1) / per_chunk;
    uint64_t first_seq = lane->seq + 1;
    for (size_t k = 0; k < chunks; k++) {
        chunk_t c = nth_chunk(sendbuf, recvbuf, count, per_chunk, &red, first_seq, k);
        if (k == 0)
            RS_CHECK(stage_chunk(lane, &c, &red));
        RS_CHECK(reduce_my_slice(lane, &c, &red, w));
        chunk_t next = k + 1 < chunks
                           ? nth_chunk(sendbuf, recvbuf, count, per_chunk, &red, first_seq, k + 1)
                           : (chunk_t){0};
        int early = k == 0 || next.count == per_chunk;
        RS_CHECK(stage_next_and_wait(lane, &c, next.count ? &next : NULL, early, &red, w));
        copy_reduced(lane, &c, &red);
    }
    return RS_OK;
}

rs_status_t rs_lane_staged_allreduce(rs_lane_t *lane, const void *sendbuf, void *recvbuf,
                                     size_t count, const rs_meta_t *meta) {
    waiting_t w = {NULL, RS_KIND_ALLREDUCE, NULL};
    rs_error_clear(&lane->error);
    return staged_allreduce(lane, sendbuf, recvbuf, count, meta, &w);
}
