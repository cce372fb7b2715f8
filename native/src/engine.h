/* Engine internals shared by engine.c (thread, handles), negotiate.c (who is ready),
 * execute.c (fusion and running collectives), timeline.c, direct.c (the same-host lane)
 * and lane.c (the lane's glue, above the engine). Which thread writes which error record:
 * see "Who touches what" in internal.h. */
#ifndef RINGSYNC_ENGINE_H
#define RINGSYNC_ENGINE_H

#include <pthread.h>
#include <stdio.h>

#include "checked.h"
#include "internal.h"
#include "util.h"

typedef struct rs_direct rs_direct_t; /* same-host lane and staged allreduce (direct.c) */


/* One submitted tensor; owned by the engine from submit until release. */
typedef struct rs_work {
    int64_t handle;
    char *name;
    rs_meta_t meta;
    const void *sendbuf;
    void *recvbuf;
    int64_t *splits; /* alltoall rows per destination (copied) */
    int start_now;
    double submitted_at;
    /* set by the engine thread; read under the engine mutex once done */
    int done;
    rs_status_t status;
    char *error;
    void *result; /* allgather / alltoall output, until taken */
    int64_t result_rows;
    int64_t *result_splits;
    int synthetic; /* made by the engine for a joined rank: zeros in, result discarded */
    int refusal;   /* stands for a call this rank refused: no handle, freed once negotiated */
    uint64_t blocking_seq; /* this rank's count of blocking calls, this one's; 0: not one */
    struct rs_work *next; /* submission queue */
} rs_work_t;


/* ---- negotiation (engine thread only) ---- */

/* A tensor some ranks have submitted and others not yet. */
typedef struct {
    char *name;
    rs_meta_t *metas;         /* per rank, valid where submitted[r] */
    unsigned char *submitted;
    int count;
    int64_t order;            /* first appearance: the order every rank runs ready tensors */
    double first_seen;
    int stall_reported;
    int last_rank;            /* the rank whose submission was recorded last */
    rs_work_t *mine;          /* this rank's request, once submitted */
    char *failure;            /* failed before it could run (blocking calls out of order) */
} rs_pending_t;

#define RS_FAILED_BLOCKING_KEEP 16 /* mismatched blocking calls remembered for late ranks */

typedef struct {
    int size;
    int rank;
    rs_map_t pending;         /* name -> rs_pending_t */
    int64_t next_order;
    uint64_t rounds;          /* negotiation rounds run (every rank runs the same) */
    /* response cache: a tensor negotiated once is later named by its id in a bitset */
    int capacity;
    int used;
    char **cache_names;
    rs_meta_t *cache_metas;
    unsigned char *cache_valid;
    rs_map_t cache_ids;       /* name -> (id + 1) */
    rs_pending_t *join;       /* the join in progress: ranks that submitted it have joined */
    /* The last blocking calls (by number) that failed as mismatched, and why: a rank that
     * submits its call of that number only later fails it too. */
    int64_t my_blocking_pending; /* this rank's blocking calls negotiation holds */
    uint64_t failed_blocking[RS_FAILED_BLOCKING_KEEP];
    char *failed_blocking_text[RS_FAILED_BLOCKING_KEEP];
    int failed_blocking_next;
} rs_negotiator_t;

rs_status_t rs_negotiator_init(rs_negotiator_t *n, int rank, int size, int capacity);
void rs_negotiator_free(rs_negotiator_t *n);
/* One negotiation round (allgathers: log2 N steps while small): exchange this rank's new
 * requests (batch) and return, in agreed order, the tensors now submitted by every rank
 * (caller frees the array and each rs_pending_t with rs_pending_free). */
rs_status_t rs_negotiate(rs_comm_t *comm, rs_negotiator_t *n, rs_work_t **batch, int nbatch,
                         rs_pending_t ***ready, int *nready);
/* NULL if every rank's metadata agree, else a message naming tensor, ranks and values. */
char *rs_check_agreement(const rs_pending_t *p, int size);
/* Remember a successfully run tensor so later submissions cost one bit. */
void rs_negotiator_cache(rs_negotiator_t *n, const rs_pending_t *p);
void rs_pending_free(rs_pending_t *p);
/* Whether p is a point-to-point message (metadata kind "send": root the sender, op the
 * receiver): ready once those two have submitted it; only they take part. */
int rs_pending_is_p2p(const rs_pending_t *p);
/* "[0, 2]": the ranks that have (want=1) or have not (want=0) submitted p. */
void rs_pending_ranks(const rs_pending_t *p, int size, int want, char *out, size_t cap);
/* Tensors waiting longer than `after` seconds, for the stall report: fills a message
 * for each not yet reported (printed on stderr). Returns the earliest time a report could
 * next be due (or 0 when none is waiting). */
double rs_negotiator_stalls(rs_negotiator_t *n, double now, double after);

/* ---- timeline (Chrome trace JSON) ---- */
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
/* CYCLE_START, an instant event on this rank's process, where mark_cycles is on. */
void rs_timeline_cycle(rs_timeline_t *t, double now);

/* ---- running ready tensors (execute.c) ---- */
typedef struct {
    rs_comm_t *comm;
    int64_t fusion_threshold;
    void *fusion;
    size_t fusion_bytes;
    rs_timeline_t *timeline;
    rs_direct_t *staged;      /* same-host staged allreduce, or NULL */
    size_t staged_min_bytes;  /* allreduces at least this large use it */
    double cycle_time_ms;     /* gather_more's longest wait */
    /* What a tune request set last (RS_TUNE_*): written by the engine thread, read
     * atomically by callers of rs_engine_settings. */
    int64_t settings[RS_TUNE_COUNT];
} rs_executor_t;

/* Run the ready tensors in order, fusing neighbouring allreduces. Each rs_work_t gets its
 * status; a communication failure is returned (every later tensor fails with it). */
rs_status_t rs_execute(rs_executor_t *x, rs_pending_t **ready, int nready);

/* ---- the same-host fast lane for blocking allreduces (direct.c) ---- */
/* NULL unless every rank of comm is on this host (shared memory) and there are several. */
rs_direct_t *rs_direct_create(rs_comm_t *comm, int area, double spin_seconds,
                              double stall_seconds, size_t max_bytes);
void rs_direct_free(rs_direct_t *d);
/* One thread at a time runs a lane operation: the caller holds the lane from before
 * rs_direct_run until it has read rs_direct_error. */
void rs_direct_lock(rs_direct_t *d);
void rs_direct_unlock(rs_direct_t *d);
/* Why the lane's last operation failed; code RS_OK when the failure was not the lane's to
 * word (the engine's failure, or the communicator's record). */
const rs_error_t *rs_direct_error(const rs_direct_t *d);
/* Post, wait for every rank's post, check agreement and, for a small allreduce, reduce.
 * *ran = 0: every rank found that the engine must run it (too large, another kind). A
 * non-zero *failure (the engine's, read atomically) ends the wait with that status. */
rs_status_t rs_direct_run(rs_direct_t *d, const char *name, const rs_meta_t *meta,
                          size_t count, const void *sendbuf, void *recvbuf,
                          const rs_status_t *failure, uint32_t epoch, int *ran);
/* Allreduce through the shared segments in chunks: each rank reduces its slice of every
 * rank's chunk, then copies the others' reduced slices (one thread per rank, in an order
 * the ranks agreed on: the engine's executor, after negotiation, on an instance that only
 * the engine thread uses, so without the lock). */
rs_status_t rs_direct_staged_allreduce(rs_direct_t *d, const void *sendbuf, void *recvbuf,
                                       size_t count, const rs_meta_t *meta);
/* Post a refusal of the blocking call `name` of `kind` in its place in the call order
 * (the peers' same call fails naming this rank and quoting `reason`), then wait until
 * every rank has posted that call. The caller holds the lane's lock. */
rs_status_t rs_direct_refuse(rs_direct_t *d, const char *name, int kind, const char *reason,
                             const rs_status_t *failure, uint32_t epoch);
/* A joined rank, until *done (read atomically) or `until` (rs_now() time): post zeros for
 * every allreduce the others post during join number `epoch` (posts carry the poster's
 * count of completed joins: one made after the join completed is left for this rank's own
 * next call). Takes the lane a slice at a time. */
void rs_direct_serve_joined(rs_direct_t *d, const int *done, uint32_t epoch, double until);

/* ---- what the engine lends the same-host lane's glue (lane.c, above engine.c) ---- */
/* The engine's lane (rs_direct_create at engine creation), or NULL. */
rs_direct_t *rs_engine_lane(rs_engine_t *e);
rs_comm_t *rs_engine_comm(rs_engine_t *e);
/* The metadata every rank compares for a request (unused fields zeroed). */
rs_meta_t rs_request_meta(const rs_request_t *r);
/* Check a request as rs_engine_submit would (a calling thread: a refusal goes into the
 * engine's error record). */
rs_status_t rs_engine_validate(rs_engine_t *e, const char *name, const rs_request_t *r);
/* Negotiate a refusal of `name` (a call of `kind` this rank refused) in the background:
 * the peers' request of that name fails, naming this rank (see rs_engine_refuse). */
void rs_engine_refuse_later(rs_engine_t *e, const char *name, int kind, int blocking);
/* What ends a lane caller's wait, for its atomic look: 0 until the engine fails (its code)
 * or a peer shuts down (RS_ERR_COMM; rs_engine_report_failure has the words). */
const rs_status_t *rs_engine_failure(rs_engine_t *e);
/* Joins this rank has completed (read atomically): the epoch that lane posts carry. */
uint32_t rs_engine_joins(rs_engine_t *e);
/* Fail the engine (the first failure sticks) and abort the communicator, which tells the
 * peers. Any thread. */
void rs_engine_fail(rs_engine_t *e, rs_status_t st, const char *text);
/* A calling thread records why its call failed in the engine's error record; returns st. */
rs_status_t rs_engine_report(rs_engine_t *e, rs_status_t st, const char *text);
/* A calling thread's call ended by the engine's failure: the failure goes into the
 * engine's error record; returns its code (st if the engine has not failed). */
rs_status_t rs_engine_report_failure(rs_engine_t *e, rs_status_t st);
rs_timeline_t *rs_engine_timeline(rs_engine_t *e);

#endif
