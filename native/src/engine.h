/* The engine's own state (struct rs_engine), shared by the two sides of it: the engine
 * thread (engine.c: negotiation rounds, running what is ready, failures, lifecycle) and
 * the calling threads (submit.c: checking and queueing requests, waiting, results, and
 * blocking calls on the same-host lane). submit.c sits above engine.c and calls into it;
 * engine.c knows nothing of submit.c. Which thread writes which error record: see "Who
 * touches what" in comm.h. */
#ifndef RINGSYNC_ENGINE_H
#define RINGSYNC_ENGINE_H

#include <pthread.h>
#include <stdint.h>

#include "comm.h"
#include "execute.h"
#include "lane.h"
#include "negotiate.h"
#include "records.h"
#include "status.h"
#include "timeline.h"
#include "util.h"
#include "work.h"

/* The name of the barrier that rs_engine_shutdown submits (see "a peer that shuts down"
 * in engine.c). */
#define SHUTDOWN_NAME "ringsync.shutdown"

struct rs_engine {
    rs_comm_t *comm;
    rs_engine_config_t config;
    pthread_t thread;
    int thread_started;
    int wake[2]; /* self-pipe: submissions and stop requests wake the thread */

    pthread_mutex_t mu; /* guards everything down to `error` */
    pthread_cond_t done_cv;
    rs_work_t *queue_head, *queue_tail; /* submitted, not yet taken by the thread */
    rs_work_t **slots;     /* the handles (submit.c): slot i's request, or NULL */
    uint32_t *generations; /* per slot: bumped on release, so a stale handle is refused */
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
     * it (see rs_lane_serve_joined). */
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

    rs_lane_t *lane; /* the same-host lane for blocking calls, or NULL */

    /* Seeing inside the job (each with its own lock; see records.h). */
    rs_flight_t flight;
    rs_stragglers_t stragglers;
    double *round_waits;   /* the engine thread's: per rank, this round's wait it caused */
    uint64_t lane_stalls_seen; /* the engine thread's: lane stalls already asked about */
    double last_stall_report;  /* the engine thread's: when a stall last asked for a report */
    /* Hang reports (under mu): the latest id asked for here and why; the latest snapshot
     * taken (id, why, the tensors negotiation held, who had submitted each). */
    uint64_t report_wanted;
    int report_wanted_reason;
    uint64_t report_id;
    int report_reason;
    rs_pending_info_t *report_items;
    unsigned char *report_submitted;
    int report_count;
    int report_waits_closed;    /* rs_engine_interrupt_waits: no report wait waits any more */
    pthread_cond_t report_cv;   /* a snapshot was taken, or the waits interrupted */
};

/* Free a request and what it holds (its result too, unless taken). */
void rs_work_free(rs_work_t *w);
/* Wake the engine thread (a pipe write; a full pipe already wakes it). Any thread. */
void rs_engine_wake(rs_engine_t *e);
/* Fail the engine (the first failure sticks) and abort the communicator, which tells the
 * peers. Any thread. */
void rs_engine_fail(rs_engine_t *e, rs_status_t st, const char *text);
/* Ask the engine thread to stop, and wait until it has (a calling thread). */
void rs_engine_stop_thread(rs_engine_t *e);

#endif
