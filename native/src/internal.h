/* Internal declarations shared by the native core's source files. */
#ifndef RINGSYNC_INTERNAL_H
#define RINGSYNC_INTERNAL_H

#include <pthread.h>

#include "ringsync.h"
#include "status.h" /* rs_error_t, RS_CHECK, RS_CHECK_GOTO */

#define RS_VERSION "0.1.0"

/* One wait request handed to a transport's poll: which peer, which direction. */
typedef struct {
    int peer; /* or RS_WAKE_PEER: the communicator's wake_fd */
    int want_read;
    int want_write;
    int ready; /* set by poll */
} rs_wait_t;

#define RS_WAKE_PEER (-1)

/* A transport moves bytes between this rank and its peers. Algorithms only see this
 * table, so a new transport touches no algorithm. send/recv never block: they move
 * what the kernel accepts now and add it to *done. poll blocks until one of the
 * waits can progress, the timeout passes (RS_OK with nothing ready is fine), or a
 * peer breaks (an error naming it). It reports in *lost_peer a peer that hung up
 * while not taking part in the waits (or -1): the caller decides whether to fail. */
typedef struct rs_transport {
    const char *name;
    rs_status_t (*listen)(rs_comm_t *comm, const char *bind_host, int *port);
    /* Connect to every peer, each connection proving knowledge of comm->secret. */
    rs_status_t (*connect)(rs_comm_t *comm, const char **hosts, const int *ports);
    rs_status_t (*send)(rs_comm_t *comm, int peer, const char *buf, size_t len, size_t *done);
    rs_status_t (*recv)(rs_comm_t *comm, int peer, char *buf, size_t len, size_t *done);
    rs_status_t (*poll)(rs_comm_t *comm, rs_wait_t *waits, int n, int timeout_ms,
                        int *lost_peer);
    void (*abort)(rs_comm_t *comm);
    void (*close)(rs_comm_t *comm);
    /* Whether the peer announced that it gave up (alive, but aborted after a failure). */
    int (*peer_aborted)(rs_comm_t *comm, int peer);
    /* From any thread, reading nothing from the stream: RS_PEER_UP, _LOST or _ABORTED. */
    int (*peer_state)(rs_comm_t *comm, int peer);
    /* Area `area` (< RS_DIRECT_AREAS) of `rank`'s shared segment, or NULL unless every
     * peer shares this host's memory with us (the same-host lane needs all of them). */
    void *(*shared_area)(rs_comm_t *comm, int rank, int area);
} rs_transport_t;

extern const rs_transport_t rs_tcp_transport;
/* Same-host peers through shared memory, the others through TCP (transport_shm.c). */
extern const rs_transport_t rs_shm_transport;
struct rs_shm;
/* After TCP has connected: map shared memory with the same-host peers and switch to the
 * shm transport. The host's ranks agree: if any cannot get its segment, all stay on TCP
 * (auto: one warning each on stderr; required: an RS_ERR_SYSTEM error on each). Required
 * also means every peer must be on this host. */
rs_status_t rs_shm_setup(rs_comm_t *comm, int required);

/* The same-host fast lane (direct.c) keeps RS_DIRECT_AREAS areas of this many bytes in
 * every rank's shared segment; a transport's shared_area finds one. */
#define RS_DIRECT_MAX_BYTES ((size_t)256 << 10) /* a one-round post, a staged chunk */
#define RS_MAX_NAME_LEN 4000 /* longest tensor name (bytes, without the NUL) */
#define RS_DIRECT_AREA_BYTES (2 * (RS_DIRECT_MAX_BYTES + RS_MAX_NAME_LEN + 1024) + 128)
#define RS_DIRECT_AREAS 2 /* the lane's (calling threads), the engine thread's */
/* What a transport's peer_state says about a peer. */
enum { RS_PEER_UP = 0, RS_PEER_LOST = 1, RS_PEER_ABORTED = 2 };
/* Average's division and the caller's postscale, after a reduction (algorithms.c). */
rs_status_t rs_finish_scale(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype,
                            rs_op_t op, double postscale);

#define RS_SECRET_MAX 64

/* Where the ranks sit (topology.c): computed by rs_comm_connect from host_names. Hosts
 * are numbered in the order of their lowest rank, a host's ranks in rank order (their
 * local index). The groups exist only where the hierarchical allreduce fits: at least 2
 * hosts, each with the same number (at least 2) of ranks. */
typedef struct {
    int hosts;        /* distinct host names */
    int hierarchical; /* the layout fits the hierarchical allreduce; the fields below are set */
    int local_size;   /* ranks on each host */
    int *local_ranks; /* this host's ranks, in rank order (local_size entries) */
    int local_index;  /* my place among them */
    int *cross_ranks; /* per host, in host order, its rank with my local index */
    int cross_index;  /* my host's number: my place among those */
} rs_topology_t;

rs_status_t rs_topology_build(rs_comm_t *comm);
void rs_topology_free(rs_topology_t *t);

/* Who touches what. Set up by the creating thread before an engine exists, then fixed:
 * rank, size, timeouts, job id and secret, host_names, topology, transport_mode,
 * spin_seconds, small_gather_bytes, hierarchical_mode and _min_bytes, count_traffic.
 * small_allreduce_bytes too, except that a tune request (autotune) changes it on the
 * engine thread: stored and read atomically everywhere. The `traffic` counters are added to by whichever thread sends
 * (the engine thread; a lane caller never sends through the transport) and read by any
 * thread: atomically, by both. The connections (transport_state, shm rings, scratch)
 * belong to the engine thread, except for what the transport table says any thread may
 * call (peer_state, shared_area, abort) and the same-host lane's own areas (direct.c),
 * which the calling threads use one at a time. `broken` is read and written atomically by
 * any thread.
 *
 * Errors travel as a status code, with the words in the record (rs_error_t, status.h)
 * of the actor that failed. The records, and which thread writes each:
 *  - the communicator's `error`: any thread (the engine thread, a caller on the
 *    same-host lane, an abort) through rs_fail, under error_mu; read whole with
 *    rs_comm_error (also under error_mu), or by the caller of the call that failed
 *    (rs_comm_last_error).
 *  - the engine's `error` (engine.c): usage errors and failed waits, written only by the
 *    threads that call the engine, under the engine's mutex; never by the engine thread.
 *    The engine's `failure` (the first fatal error, which every later request fails with)
 *    is written once, by whichever thread fails the engine, also under the mutex.
 *  - the lane's `error` (direct.c): the thread that holds the lane's lock (the executor's
 *    staged instance belongs to the engine thread alone, without the lock). The lane's
 *    glue (lane.c) copies it before it lets the lane go, then fails the engine or writes
 *    the engine's `error`.
 * A request's text (rs_work_t.error) is its result, not a channel: set with its status
 * before the request is marked done under the engine's mutex, read only after. Text that
 * only builds a message (rs_peer_gone_text, rs_format_ranks) is no channel either: the
 * caller records the error. */
struct rs_comm {
    int rank;
    int size;
    double timeout_seconds; /* no progress for this long fails (0: no limit) */
    double setup_seconds;   /* connecting to every peer must finish within this */
    uint64_t job_id;        /* public: names this job's shared segments */
    unsigned char secret[RS_SECRET_MAX]; /* what every connection proves it knows */
    size_t secret_len;
    const rs_transport_t *transport;
    void *transport_state;
    char **host_names; /* per rank, for error messages */
    int broken;        /* atomic: set by rs_fail for recoverable errors, never cleared */
    pthread_mutex_t error_mu; /* one writer (or whole-record reader) of `error` at a time */
    rs_error_t error;         /* the last failure, in words (rs_fail) */
    void *scratch; /* grows on demand; owned by the communicator, not global */
    size_t scratch_bytes;
    int wake_fd; /* an engine's self-pipe, polled while idle (-1: none) */
    int engine_attached;
    int transport_mode;  /* RS_TRANSPORT_*: what rs_comm_connect sets up */
    struct rs_shm *shm;  /* the shared-memory rings, or NULL */
    double spin_seconds; /* how long a shared-memory wait spins before it blocks */
    size_t small_allreduce_bytes; /* up to this size, allreduce exchanges whole buffers */
    size_t small_gather_bytes;    /* allgathers up to this total take log2(N) rounds */
    rs_topology_t topology;       /* hosts and the hierarchical allreduce's groups */
    int hierarchical_mode;        /* RS_HIERARCHICAL_*: when allreduce goes hierarchical */
    size_t hierarchical_min_bytes; /* auto: from this size on */
    /* Bytes sent to each peer since connecting (not the setup), by how they went: the
     * first `size` entries through TCP, the next `size` through shared-memory rings. */
    int64_t *traffic;
    int count_traffic; /* set once setup is over: its exchanges are not traffic */
};

enum { RS_VIA_TCP = 0, RS_VIA_SHM = 1 };

/* A debug counter: the transports' sends report the bytes they moved to `peer` (a
 * negative count takes back bytes that were no data). Relaxed atomics: a total, read by
 * tests after the collectives they look at have completed. */
static inline void rs_count_sent(rs_comm_t *comm, int via, int peer, int64_t bytes) {
    if (comm->count_traffic && bytes)
        __atomic_fetch_add(&comm->traffic[(size_t)via * comm->size + peer], bytes,
                           __ATOMIC_RELAXED);
}

/* Record an error in words; recoverable kinds also mark the communicator broken. */
rs_status_t rs_fail(rs_comm_t *comm, rs_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A consistent copy of the communicator's error record (another thread may be writing
 * it); returns its code. */
rs_status_t rs_comm_error(rs_comm_t *comm, rs_error_t *out);
const char *rs_peer_host(const rs_comm_t *comm, int peer);
double rs_now(void);
/* Fail with a message that tells a lost peer from one that aborted. */
rs_status_t rs_fail_lost_peer(rs_comm_t *comm, int peer);
/* The words for how a wait ends, shared by the engine, the negotiation, the transports and
 * the lane: a peer lost (or aborted after a failure elsewhere); a stall report (printed
 * on stderr); a tensor that some ranks never submitted within the timeout. */
void rs_peer_gone_text(const rs_comm_t *comm, int peer, int aborted, char *out, size_t cap);
void rs_report_stall(const char *name, int kind, const char *have, const char *missing,
                     double waited);
void rs_submit_timeout_text(const rs_comm_t *comm, const char *name, int kind, double waited,
                            const char *missing, char *out, size_t cap);
rs_status_t rs_scratch(rs_comm_t *comm, size_t bytes, void **out);

/* A transfer to or from one peer, progressed together with others by rs_progress. */
typedef struct rs_xfer rs_xfer_t;
struct rs_xfer {
    int peer;
    int is_send;
    char *buf;
    size_t len;
    size_t done;
    const size_t *avail;  /* send only: bytes below *avail may go (chain forwarding) */
    void (*on_recv)(rs_xfer_t *x); /* recv only: called after bytes arrive */
    void *arg;
};

/* Progress all transfers until every one is done, a peer fails, or no byte has moved
 * for the communicator's timeout. */
rs_status_t rs_progress(rs_comm_t *comm, rs_xfer_t *xfers, int n);
/* The same, but return as soon as one pair (xfers[2i], xfers[2i+1]) is done: n is even;
 * a pipeline runs a step of each of its stages at once. */
rs_status_t rs_progress_any_pair(rs_comm_t *comm, rs_xfer_t *xfers, int n);

static inline rs_xfer_t rs_send_to(int peer, const void *buf, size_t len) {
    rs_xfer_t x = {.peer = peer, .is_send = 1, .buf = (char *)buf, .len = len};
    return x;
}

static inline rs_xfer_t rs_recv_from(int peer, void *buf, size_t len) {
    rs_xfer_t x = {.peer = peer, .is_send = 0, .buf = (char *)buf, .len = len};
    return x;
}

/* small_gather_bytes until rs_comm_set_small_gather (Python sets it from its Config).
 * Each rank sends as many bytes either way when the ranks' parts are equal, so the ring
 * can only win on links the log rounds share badly (many ranks per host crossing hosts at
 * once in the late rounds, parts of very different sizes). Measured on one 2-core host,
 * thread ranks over loopback TCP, median us, ring / log rounds, by total bytes:
 *   N=4: 4 KiB 185/111, 64 KiB 223/162, 512 KiB 1543/729, 2 MiB 7238/4682, 8 MiB 24405/18046
 *   N=8: 8 KiB 639/380, 128 KiB 761/612, 1 MiB 4290/3115, 4 MiB 15182/17027,
 *        16 MiB 100533/78823
 * No crossover on one host up to 16 MiB; 1 MiB keeps every negotiation round (at most
 * (32 + 8 * cache bitset words) bytes per rank: 544 with the default 4096 entries, so
 * up to ~1900 ranks) and small user gathers on the log rounds, large ones on the ring. */
#define RS_SMALL_GATHER_BYTES ((size_t)1 << 20)
/* Allgatherv in ceil(log2 N) rounds (gather_log.c): the same contract as rs_allgatherv,
 * for any N and any counts; rs_allgatherv picks it for gathers up to small_gather_bytes. */
rs_status_t rs_allgatherv_log(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                              const int64_t *counts, size_t elem_bytes);
/* The total bytes of an allgather's counts, refusing (RS_ERR_USAGE) a negative count or a
 * total past RS_MAX_BYTES (counts may come from peers). */
rs_status_t rs_gather_total(rs_comm_t *comm, const int64_t *counts, size_t elem_bytes,
                            size_t *total);

/* Adasum allreduce of `count` elements of buf, in place (adasum.c): RS_ERR_USAGE unless
 * dtype is floating point. Scale factors are the caller's. */
rs_status_t rs_adasum_allreduce(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype);

/* Reduction kernels (reduce.c). Average reduces as Sum; the caller scales. */
typedef void (*rs_reduce_fn)(void *inout, const void *in, size_t count);
rs_reduce_fn rs_reduce_kernel(rs_dtype_t dtype, rs_op_t op);
int rs_dtype_valid(int dtype);
int rs_dtype_movable(int dtype); /* valid, or bool (moved, never reduced) */
int rs_dtype_is_integer(rs_dtype_t dtype);
int rs_op_valid(int op);
int rs_dtype_is_float(int dtype);
/* Whether op can reduce dtype (Adasum: floating point only). */
int rs_op_takes_dtype(int op, int dtype);
/* Adasum's arithmetic on one piece of vectors a and b: sums = {dot(a, b), |a|^2, |b|^2}
 * (accumulated in double; float16 / bfloat16 through float); then, with sums over the
 * whole vectors, out = ca*a + cb*b where ca = 1 - dot / (2|a|^2) (1 when |a|^2 is below
 * sqrt(DBL_MIN)) and cb likewise. out may be a or b. RS_ERR_USAGE for other dtypes. */
rs_status_t rs_adasum_dots(const void *a, const void *b, size_t count, rs_dtype_t dtype,
                           double sums[3]);
rs_status_t rs_adasum_combine(void *out, const void *a, const void *b, size_t count,
                              rs_dtype_t dtype, const double sums[3]);

/* ---- rings over a group of the communicator's ranks (ring.c) ---- */

/* A ring over some of the communicator's ranks: position i is rank ranks[i] (ranks NULL:
 * rank i, the flat ring over every rank); `me` is this rank's position. */
typedef struct {
    const int *ranks;
    int n;
    int me;
} rs_group_t;

static inline rs_group_t rs_group_all(const rs_comm_t *comm) {
    return (rs_group_t){NULL, comm->size, comm->rank};
}

/* A buffer cut into blocks, one per ring position: sizes and offsets in bytes (one
 * allocation: free(bytes)). */
typedef struct {
    size_t *bytes;
    size_t *offset;
} rs_blocks_t;

/* `count` elements of `unit` bytes (count * unit must not overflow: the caller checks)
 * in `parts` nearly equal blocks (rs_even_part). */
rs_status_t rs_blocks_even(rs_comm_t *comm, size_t count, int parts, size_t unit,
                           rs_blocks_t *b);
/* One ring pass over a group, taken a step at a time (rs_ring_step): steps 0..n-2
 * reduce-scatter buf's blocks (into `incoming`, a buffer of the largest block, reduced
 * with fn as bytes arrive), steps n-1..2n-3 allgather them. */
typedef struct {
    const rs_group_t *g;
    const rs_blocks_t *blocks;
    char *buf;
    size_t elem;
    rs_reduce_fn fn;
    char *incoming;
} rs_ring_run_t;
/* Where a reduce-scatter step reduces what arrives (x->arg of its receive). */
typedef struct {
    rs_reduce_fn fn;
    char *dst;
    size_t elem;
    size_t reduced; /* bytes of the block already reduced */
} rs_ring_arrival_t;
/* The two transfers of step s (send to the next member, receive from the previous); a
 * reduce-scatter step's receive reduces through *arrival, which must outlive them. */
void rs_ring_step(const rs_ring_run_t *run, int s, rs_xfer_t x[2], rs_ring_arrival_t *arrival);
size_t rs_largest_block(const rs_blocks_t *b, int n);
/* In place: afterwards block g->me holds the reduction of that block over the group. */
rs_status_t rs_ring_reduce_scatter(rs_comm_t *comm, const rs_group_t *g, char *buf,
                                   const rs_blocks_t *b, size_t elem, rs_reduce_fn fn);
/* In place: block g->me is this rank's; afterwards it holds every member's block. */
rs_status_t rs_ring_allgather(rs_comm_t *comm, const rs_group_t *g, char *buf,
                              const rs_blocks_t *b);
/* Reduce-scatter, then allgather: the group's reduction of buf, the same bits on every
 * member. */
rs_status_t rs_ring_allreduce(rs_comm_t *comm, const rs_group_t *g, char *buf, size_t count,
                              size_t elem, rs_reduce_fn fn);

/* ---- the hierarchical allreduce (hierarchical.c) ---- */

/* Whether an allreduce of `bytes` goes hierarchical: the topology fits, and the mode is
 * on, or auto with bytes at least hierarchical_min_bytes. */
int rs_hierarchical_chosen(const rs_comm_t *comm, size_t bytes);
/* In place, over the topology's groups (only where topology.hierarchical). */
rs_status_t rs_hierarchical_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                      rs_reduce_fn fn);

#endif
