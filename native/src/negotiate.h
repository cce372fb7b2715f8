/* Negotiation (negotiate.c): which tensors every rank has submitted, in an order all
 * ranks agree on, and whether their metadata agree. The engine thread's alone (the lane
 * borrows the agreement check, rs_check_agreement). */
#ifndef RINGSYNC_NEGOTIATE_H
#define RINGSYNC_NEGOTIATE_H

#include <stdint.h>

#include "checked.h"
#include "comm.h"
#include "util.h"
#include "work.h"

/* A tensor some ranks have submitted and others not yet. */
typedef struct {
    char *name;
    rs_meta_t *metas;         /* per rank, valid where submitted[r] */
    unsigned char *submitted;
    int count;
    int64_t order;            /* first appearance: the order every rank runs ready tensors */
    double first_seen;
    /* Arrivals, on this rank's clock of rounds: when each rank's submission came, and the
     * last two rounds that brought any (for the straggler events: see rs_pending_waits). */
    double *arrived_at;
    double last_arrival, prev_arrival;
    int stall_reported;
    int last_rank;            /* the rank whose submission was recorded last */
    rs_work_t *mine;          /* this rank's request, once submitted */
    char *failure;            /* failed before it could run (blocking calls out of order) */
} rs_pending_t;

#define RS_FAILED_BLOCKING_KEEP 16 /* mismatched blocking calls remembered for late ranks */

typedef struct {
    rs_comm_t *comm; /* whose record takes the words of a failure (out of memory) */
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
    /* Hang reports: the latest report id (<< 8 | reason) every rank has seen; this rank
     * asks for a newer one by setting report_ask before a round. report_new: the last
     * round brought a newer one. */
    uint64_t report;
    uint64_t report_ask;
    int report_new;
} rs_negotiator_t;

rs_status_t rs_negotiator_init(rs_negotiator_t *n, rs_comm_t *comm, int capacity);
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
double rs_negotiator_stalls(rs_negotiator_t *n, double now, double after, int *reported);
/* A ready collective that every rank submitted: how long the others waited for the ranks
 * whose submissions came in its last round of arrivals (waits[r] raised to it for each);
 * returns 0 (waits untouched) for a message, a join, a failure, or one that joined ranks
 * did not submit. */
int rs_pending_waits(const rs_pending_t *p, int size, double *waits);

#endif
