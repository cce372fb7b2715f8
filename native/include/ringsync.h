/* ringsync native core: the one public header.
 *
 * This file is read twice: by the C compiler, and by cffi's cdef (the build script
 * strips the preprocessor lines). Keep it to plain declarations cffi understands.
 *
 * Every call returns an rs_status_t. On failure the communicator's last-error string
 * (rs_comm_last_error) says what happened in words. RS_ERR_COMM and RS_ERR_TIMEOUT are
 * "recoverable" errors: the communicator is broken and must be rebuilt. RS_ERR_USAGE and
 * RS_ERR_NOMEM leave the communicator usable for the next call.
 */
#ifndef RINGSYNC_H
#define RINGSYNC_H
#include <stddef.h>
#include <stdint.h>

typedef enum {
    RS_OK = 0,
    RS_ERR_USAGE = 1,   /* bad arguments; the communicator still works */
    RS_ERR_NOMEM = 2,   /* allocation failed; the communicator still works */
    RS_ERR_COMM = 3,    /* a peer connection broke; the communicator is broken */
    RS_ERR_TIMEOUT = 4, /* no progress before the deadline; the communicator is broken */
    RS_ERR_SYSTEM = 5   /* a system call failed while setting up */
} rs_status_t;

typedef enum {
    RS_UINT8 = 0,
    RS_INT8 = 1,
    RS_INT32 = 2,
    RS_INT64 = 3,
    RS_FLOAT16 = 4,
    RS_BFLOAT16 = 5,
    RS_FLOAT32 = 6,
    RS_FLOAT64 = 7,
    RS_BOOL = 8, /* moved by allgather, broadcast and alltoall; never reduced */
    RS_INT16 = 9,
    RS_UINT16 = 10
} rs_dtype_t;

typedef enum {
    RS_OP_SUM = 0,
    RS_OP_AVERAGE = 1,
    RS_OP_MIN = 2,
    RS_OP_MAX = 3,
    RS_OP_PRODUCT = 4,
    /* Adaptive summation (Maleki et al. 2020) per tensor, floating point only: pairs of
     * vectors a, b combine as (1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b up a binary tree of
     * ranks. Never fused with other tensors; not divided by the rank count. */
    RS_OP_ADASUM = 5
} rs_op_t;

typedef struct rs_comm rs_comm_t;

const char *rs_version(void);
size_t rs_dtype_size(rs_dtype_t dtype);

/* --- communicator lifecycle (bootstrap hands in addresses; no MPI here) --- */

/* Create a communicator for `rank` of `size` and open its listening socket on
 * bind_host (numeric IPv4/IPv6; "" = all interfaces). The chosen port is returned.
 * timeout_seconds: longest wait without progress once connected (0: no limit; a dead
 * peer is still noticed through its socket). Connecting is bounded by setup_seconds. */
rs_status_t rs_comm_create(int rank, int size, const char *bind_host, double timeout_seconds,
                           double setup_seconds, rs_comm_t **out_comm, int *out_port);
/* Connect to every peer. hosts[i]/ports[i] say where rank i listens; host_names[i] is the
 * peer's host name, used only in error messages. job_id is public (it names shared
 * segments); `secret` (secret_len bytes, 16 to 64, the same on every rank, handed out
 * over MPI) is what a connection proves it knows, by challenge and response in both
 * directions: it never crosses the wire. */
rs_status_t rs_comm_connect(rs_comm_t *comm, const char **hosts, const int *ports,
                            const char **host_names, uint64_t job_id,
                            const unsigned char *secret, size_t secret_len);
/* Which transport rs_comm_connect sets up: shared memory with same-host peers and TCP
 * with the others (AUTO, the default), TCP only, or shared memory only (every peer must
 * be on this host). Call before rs_comm_connect. */
typedef enum { RS_TRANSPORT_AUTO = 0, RS_TRANSPORT_TCP = 1, RS_TRANSPORT_SHM = 2 } rs_transport_mode_t;
rs_status_t rs_comm_set_transport(rs_comm_t *comm, int mode);
/* How long a wait on a same-host peer spins before it blocks (0: block at once). Spinning
 * saves a wake-up when the peer answers within that time, and costs a core meanwhile. */
rs_status_t rs_comm_set_spin(rs_comm_t *comm, double seconds);
/* Allreduces of at most `bytes` send every rank's whole buffer to every peer in one round
 * (latency: one exchange) instead of the ring (2(N-1) exchanges); 0 always uses the ring. */
rs_status_t rs_comm_set_small_allreduce(rs_comm_t *comm, size_t bytes);
/* Allgathers of at most `bytes` in all (the engine's negotiation rounds among them) take
 * ceil(log2 N) rounds, each rank sending what it has gathered so far to rank - 2^k;
 * larger ones go around the ring (N - 1 rounds). 0 always uses the ring. */
rs_status_t rs_comm_set_small_gather(rs_comm_t *comm, size_t bytes);
/* When allreduce goes hierarchical (reduce-scatter inside each host, allreduce of each
 * slice across hosts, allgather inside each host) instead of around the flat ring: never
 * (OFF), always (ON: every allreduce, the small ones included), or (AUTO, the default)
 * from min_bytes on, above the small-allreduce size. Only where the ranks span at least
 * two hosts with the same number (at least two) of ranks each; elsewhere the flat ring.
 * Adasum keeps its own algorithm. */
typedef enum {
    RS_HIERARCHICAL_OFF = 0,
    RS_HIERARCHICAL_ON = 1,
    RS_HIERARCHICAL_AUTO = 2
} rs_hierarchical_mode_t;
rs_status_t rs_comm_set_hierarchical(rs_comm_t *comm, int mode, size_t min_bytes);
/* Non-zero: allreduce and reducescatter fold every element in rank order (rank 0's
 * prescaled value, then rank 1's, ...; Average's division and the postscale after), so
 * their bits depend only on the inputs and the rank count: never on the sizes, the fusion,
 * the crossovers or the path. Large allreduces then exchange even blocks in one round and
 * allgather them around the ring (the ring's bytes; across hosts, no hierarchical
 * allreduce); Adasum is unchanged. Every rank must set the same; call before the engine
 * starts. */
rs_status_t rs_comm_set_deterministic(rs_comm_t *comm, int on);
/* A debug counter: the bytes this rank has sent to each rank (size entries each) through
 * TCP and through shared-memory rings since it connected, setup and shared-memory wake-ups
 * not included. The same-host lane and the staged allreduce, which work in shared areas
 * rather than sending, are not counted. */
rs_status_t rs_comm_traffic(const rs_comm_t *comm, int64_t *tcp_bytes, int64_t *shm_bytes);
/* A debug counter: how many threads are blocked in rs_engine_wait on this communicator's
 * engine now (while any is, the engine's shared-memory waits spin for the lane's spin
 * time instead of sleeping at once). */
int rs_comm_callers_waiting(const rs_comm_t *comm);
/* The transport in use after connect: "tcp" or "shm" (shm with same-host peers). */
const char *rs_comm_transport_name(const rs_comm_t *comm);
/* Break every connection now (peers see the failure); the communicator stays allocated. */
rs_status_t rs_comm_abort(rs_comm_t *comm);
void rs_comm_destroy(rs_comm_t *comm);
const char *rs_comm_last_error(const rs_comm_t *comm);
int rs_comm_rank(const rs_comm_t *comm);
int rs_comm_size(const rs_comm_t *comm);
/* Non-zero once a recoverable error has broken this communicator. */
int rs_comm_is_broken(const rs_comm_t *comm);

/* --- collectives (blocking; release the GIL through cffi) --- */

/* Allreduce of `count` elements from sendbuf into recvbuf (they may be equal): one round
 * for small buffers (rs_comm_set_small_allreduce), hierarchical across hosts where chosen
 * (rs_comm_set_hierarchical), else the ring; in rank order where deterministic
 * (rs_comm_set_deterministic). */
rs_status_t rs_allreduce(rs_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count,
                         rs_dtype_t dtype, rs_op_t op, double prescale, double postscale);
/* recvbuf receives `counts[i]` elements from every rank i in rank order. Element
 * size is elem_bytes (data is moved, not reduced). */
rs_status_t rs_allgatherv(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                          const int64_t *counts, size_t elem_bytes);
/* Pipelined chain broadcast of `bytes` bytes from root (in place). */
rs_status_t rs_broadcast(rs_comm_t *comm, void *buf, size_t bytes, int root);
/* sendbuf holds sum(counts) elements; rank i receives the reduction of block i
 * (counts[i] elements) into recvbuf. recvbuf == sendbuf: in place, as MPI_IN_PLACE (the
 * buffer is the work space, overwritten; the result is at its start). */
rs_status_t rs_reducescatter(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                             const int64_t *counts, rs_dtype_t dtype, rs_op_t op,
                             double prescale, double postscale);
/* Rank r sends send_counts[i] bytes to rank i (blocks in rank order in sendbuf) and
 * receives recv_counts[i] bytes from rank i (in rank order in recvbuf). */
rs_status_t rs_alltoallv(rs_comm_t *comm, const void *sendbuf, const int64_t *send_counts,
                         void *recvbuf, const int64_t *recv_counts);
rs_status_t rs_barrier(rs_comm_t *comm);

/* Apply a reduction to two local buffers: inout[i] = op(inout[i], in[i]). Exposed for tests. */
rs_status_t rs_reduce_local(void *inout, const void *in, size_t count, rs_dtype_t dtype,
                            rs_op_t op);
/* Integer Average's division: buf[i] /= divisor (>= 1), truncated toward zero, computed
 * in int64 whatever the element type. Exposed for tests. */
rs_status_t rs_divide_local(void *buf, size_t count, rs_dtype_t dtype, int divisor);
/* buf[i] *= factor, computed in float32/float64 (integers are truncated toward zero). */
rs_status_t rs_scale_local(void *buf, size_t count, rs_dtype_t dtype, double factor);

/* --- the engine: a background thread per communicator that negotiates, fuses and runs
 * requests. Submitting returns handles at once; every collective above then runs on the
 * engine's thread, which is the only one touching the communicator's connections. --- */

typedef struct rs_engine rs_engine_t;

enum { RS_MAX_DIMS = 8 };

typedef enum {
    RS_KIND_ALLREDUCE = 0,
    RS_KIND_ALLGATHER = 1,
    RS_KIND_BROADCAST = 2,
    RS_KIND_REDUCESCATTER = 3,
    RS_KIND_ALLTOALL = 4,
    RS_KIND_BARRIER = 5,
    /* This rank has no more data: until every rank has joined, it takes part in the other
     * ranks' allreduces with zeros. The handle's result (rows) is the last rank to join. */
    RS_KIND_JOIN = 6,
    /* Point-to-point: `root` is the peer (the destination of a send, the source of a
     * recv); sendbuf (send) or recvbuf (recv, written whole) holds the tensor. A send
     * completes once its receiver has posted the matching recv and the bytes have moved
     * (synchronous, like MPI_Ssend). The k-th unnamed send from A to B matches the k-th
     * unnamed recv on B from A; a named one matches the recv of the same name (an empty
     * name is unnamed). The receiver's dtype and shape must equal the sender's. */
    RS_KIND_SEND = 7,
    RS_KIND_RECV = 8,
    /* New engine settings, applied by every rank at the same point of the agreed order
     * (autotune): shape[RS_TUNE_...] holds them, ndim = RS_TUNE_COUNT; no data. Ranks whose
     * values differ fail it as any mismatch, naming both. */
    RS_KIND_TUNE = 9,
    /* Not submitted by callers: the engine's stand-in for a call this rank refused (its
     * arguments failed the local checks), so that the peers' matching call fails too
     * instead of waiting for it (rs_engine_refuse). `root` holds the refused call's kind. */
    RS_KIND_REFUSED = 10
} rs_kind_t;

enum {
    RS_TUNE_FUSION_THRESHOLD = 0, /* bytes; 0: no fusion */
    RS_TUNE_CYCLE_TIME_US = 1,    /* microseconds */
    RS_TUNE_STAGED_BYTES = 2,     /* same-host staged allreduce from this size */
    RS_TUNE_SMALL_ALLREDUCE = 3,  /* one-round allreduce up to this size */
    RS_TUNE_COUNT = 4
};

/* One tensor. Buffers stay the caller's and must live until the handle completes.
 * allreduce: sendbuf -> recvbuf (may be equal). broadcast: in place on recvbuf.
 * reducescatter: recvbuf holds this rank's rows. allgather / alltoall: the engine
 * allocates the output (rs_engine_result hands it over). */
typedef struct {
    int kind;
    int dtype;
    int op;
    int root;
    double prescale;
    double postscale;
    int ndim;
    int64_t shape[8];
    const void *sendbuf;
    void *recvbuf;
    const int64_t *splits; /* alltoall: rows sent to each rank (size entries); NULL = even */
    int start_now;         /* a caller is waiting now: do not hold it back to fuse more */
    /* A blocking call (the caller waits for it alone, as the plain collectives do): such
     * calls of one tensor are matched in call order on every path, as MPI's are, so that
     * ranks calling different names fail the same call instead of waiting for each
     * other (asynchronous ones are matched by name, in any order). */
    int blocking;
} rs_request_t;

typedef struct {
    int64_t fusion_threshold_bytes; /* 0 disables fusion */
    double cycle_time_ms;           /* longest wait to gather more tensors into one fusion */
    double stall_check_seconds;     /* report tensors some ranks have not submitted */
    int cache_capacity;             /* negotiation cache entries */
    double lane_spin_seconds;       /* same-host lane: spin this long before sleeping */
    int64_t lane_max_bytes;         /* same-host lane: largest allreduce (0: no lane) */
    int64_t staged_min_bytes;       /* every rank on this host: allreduces at least this large
                                       reduce through shared memory, not the ring (0: never) */
    int flight_records;             /* collectives the flight recorder keeps (0: none, and no
                                       straggler events either) */
    int report_on_stall;            /* rank 0: a stall report asks every rank for a hang report */
} rs_engine_config_t;

rs_status_t rs_engine_create(rs_comm_t *comm, const rs_engine_config_t *config,
                             rs_engine_t **out_engine);
/* Submit n requests atomically (a group is fused as one unit); handles[i] receives each. */
rs_status_t rs_engine_submit(rs_engine_t *engine, const char **names, const rs_request_t *requests,
                             int n, int64_t *handles);
/* A blocking call on the same-host lane: when every rank is on this host, ranks post the
 * call's header (name, kind, dtype, shape, op) in shared memory, and every rank checks them
 * all: a disagreement fails here on every rank. A small allreduce (its data posted too,
 * each rank reducing all posts in rank order) and a barrier then complete on the calling
 * thread, without the engine thread or negotiation; *ran = 0 for the others, which every
 * rank then submits to the engine. Blocking calls must come in the same order on every
 * rank (as they must anyway: each waits for all ranks); a joined rank takes part in
 * allreduces with zeros. Does nothing (*ran = 0) unless every rank is on this host, and
 * for joins. */
rs_status_t rs_engine_try_lane(rs_engine_t *engine, const char *name,
                                    const rs_request_t *request, int *ran);
/* This rank refused the call `name` of `kind` (its arguments failed a check here, with
 * `reason`): make the peers' matching call fail too, so that the ranks stay matched. A
 * blocking call on the same-host lane posts the refusal in its place in the call order
 * and waits until every rank has posted that call (the peers fail it naming this rank and
 * the reason); otherwise the refusal is negotiated under `name` in the background (no
 * handle; the peers' request of that name fails naming this rank). rs_engine_submit and
 * rs_engine_try_lane refuse by themselves when their own checks fail; this is for checks
 * made above the engine. Returns RS_OK, or the failure that ended the wait. */
rs_status_t rs_engine_refuse(rs_engine_t *engine, const char *name, int kind,
                             const char *reason, int blocking);
/* Whether rs_engine_try_lane can run anything (every rank on this host). */
int rs_engine_has_lane(rs_engine_t *engine);
/* The settings the engine runs with now, RS_TUNE_COUNT values in RS_TUNE_* order: the
 * configured ones until a tune request (RS_KIND_TUNE) has run. Any thread. */
void rs_engine_settings(rs_engine_t *engine, int64_t *out);
/* 1 when the handle has completed (successfully or not), 0 while pending, -1 if unknown. */
int rs_engine_poll(rs_engine_t *engine, int64_t handle);
/* Wait up to timeout_seconds; *done says whether it completed. Returns its status. */
rs_status_t rs_engine_wait(rs_engine_t *engine, int64_t handle, double timeout_seconds, int *done);
/* The error text of a completed, failed handle (valid until release). */
const char *rs_engine_handle_error(rs_engine_t *engine, int64_t handle);
/* Output of allgather / alltoall: ownership of *data passes to the caller (rs_free).
 * recv_splits (size entries, may be NULL) receives alltoall's rows from each rank. */
rs_status_t rs_engine_take_result(rs_engine_t *engine, int64_t handle, void **data,
                                  int64_t *rows, int64_t *recv_splits);
void rs_engine_release(rs_engine_t *engine, int64_t handle);
/* Collective: waits (bounded by the timeout) until every rank shuts down, then stops. */
rs_status_t rs_engine_shutdown(rs_engine_t *engine);
/* Fails every pending and later request with `reason` and aborts the communicator, so
 * that peers fail too instead of waiting for this rank (elastic recovery starts here).
 * Safe from any thread, while the engine is in the middle of a round. */
rs_status_t rs_engine_abort(rs_engine_t *engine, const char *reason);
/* Stops the thread and fails every pending handle; does not touch the communicator. */
void rs_engine_destroy(rs_engine_t *engine);
const char *rs_engine_last_error(rs_engine_t *engine);
/* mark_cycles: an instant event (CYCLE_START) at the start of each negotiation round. */
rs_status_t rs_engine_start_timeline(rs_engine_t *engine, const char *path, int mark_cycles);
rs_status_t rs_engine_stop_timeline(rs_engine_t *engine);
void rs_free(void *p);

/* ---- seeing inside a job: the flight recorder, straggler events, hang reports ---- */

/* One collective this rank issued (the flight recorder keeps the last
 * rs_engine_config_t.flight_records of them). status: an rs_status_t, or RUNNING. The
 * name is cut to 159 bytes. Times are rs_now()'s (monotonic seconds). route: ENGINE or
 * LANE (a blocking call on the same-host lane). */
enum { RS_FLIGHT_RUNNING = -1, RS_FLIGHT_HANDED_OVER = -2 };
enum { RS_ROUTE_ENGINE = 0, RS_ROUTE_LANE = 1 };
typedef struct {
    uint64_t seq;
    char name[160];
    int kind;
    int dtype;
    int op;
    int root;
    int ndim;
    int route;
    int status;
    int64_t shape[8];
    double start;
    double end;
} rs_flight_record_t;
/* Copy the flight records, oldest first (at most max); returns how many. Any thread. */
int rs_engine_flight_records(rs_engine_t *engine, rs_flight_record_t *out, int max);
/* The monotonic clock the records use (seconds). */
double rs_monotonic_seconds(void);

/* In a negotiation round that made collectives ready, the ranks whose submissions came
 * last kept the others waiting for wait_seconds: the time between the round in which the
 * others' had all come and the round in which theirs came, on this rank's clock (rounds
 * are collective, so every rank measures about the same without synchronized clocks).
 * round counts those rounds from 1. */
typedef struct {
    uint64_t round;
    int rank;
    double wait_seconds;
} rs_wait_event_t;
/* The latest events, oldest first (at most max); *rounds: rounds counted so far. */
int rs_engine_wait_events(rs_engine_t *engine, rs_wait_event_t *out, int max,
                          uint64_t *rounds);

/* Hang reports. A request (any rank: a signal, the user) rides on the next negotiation
 * round, which the requesting engine starts at once; every rank's engine then takes a
 * snapshot of the tensors negotiation holds. reason: 1 a stall (rank 0 asks by itself
 * where rs_engine_config_t.report_on_stall is set), 2 a request. */
enum { RS_REPORT_STALL = 1, RS_REPORT_REQUEST = 2 };
void rs_engine_request_report(rs_engine_t *engine, int reason);
/* Wait until a report newer than `after` has been taken (up to timeout_seconds); returns
 * its id (0 otherwise) and its reason. Once rs_engine_interrupt_waits was called (before
 * the engine is destroyed), every wait, now or later, returns at once. */
uint64_t rs_engine_wait_report(rs_engine_t *engine, uint64_t after, double timeout_seconds,
                               int *reason);
void rs_engine_interrupt_waits(rs_engine_t *engine);
/* 1 when signal signum's action in this process is the default or ignore: no handler
 * (Python's, or a C one such as faulthandler's, which Python cannot see) has it. */
int rs_signal_unclaimed(int signum);
/* One tensor of the latest snapshot: submitted[rank] (size entries per tensor, in the
 * caller's array) says who has submitted it; mine: this rank has. */
typedef struct {
    char name[4001];
    int kind;
    int mine;
    double waited_seconds;
} rs_pending_info_t;
/* The latest snapshot's tensors (at most max; *total: how many it holds). */
int rs_engine_report_pending(rs_engine_t *engine, rs_pending_info_t *out,
                             unsigned char *submitted, int max, int *total);

/* ---- XLA FFI (ringsync.jax): the blocking allreduce as a custom call of a compiled JAX
 * program. The handler finds its engine in a process-wide table of slots (one per process
 * set a program names: XLA gives a handler no user data). */
/* The handler (an XLA_FFI_Handler) for jax.ffi.register_ffi_target. */
void *rs_xla_allreduce_handler(void);
/* Slot `slot` (< 64) runs on `engine` of ring `comm` (rank `rank` of it) from now on;
 * NULLs empty it. */
rs_status_t rs_xla_bind(int slot, rs_engine_t *engine, rs_comm_t *comm, int rank);
/* Empty every slot bound to `engine` (before destroying it; waits for running handlers). */
void rs_xla_forget(rs_engine_t *engine);

#endif
