/* The communicator's state (struct rs_comm), which every layer of the core reads: types
 * and constants only. comm.c, which creates and destroys it, exports nothing beyond the
 * public API (ringsync.h), so this header belongs to no file and any file may include it
 * (tests/unit/test_native_layers.py: a header that names no function of the core). */
#ifndef RINGSYNC_COMM_H
#define RINGSYNC_COMM_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "ringsync.h"
#include "status.h" /* rs_error_t */

#define RS_SECRET_MAX 64

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
    int *host_ranks;  /* every host's ranks: [h * local_size + i] is host h's local index i */
} rs_topology_t;

struct rs_transport; /* the table a transport fills (transport.h) */
struct rs_shm;       /* the shared-memory rings (transport_shm.c) */

/* Who touches what. Set up by the creating thread before an engine exists, then fixed:
 * rank, size, timeouts, job id and secret, host_names, topology, transport_mode,
 * spin_seconds, small_gather_bytes, hierarchical_mode and _min_bytes, deterministic,
 * count_traffic, waiting_spin_seconds (by the engine's creation).
 * callers_waiting is added to and read atomically by any thread (the calling threads
 * around their wait in rs_engine_wait; the engine thread's shared-memory waits read it).
 * small_allreduce_bytes too, except that a tune request (autotune) changes it on the
 * engine thread: stored and read atomically everywhere. The `traffic` counters are added
 * to by whichever thread sends (the engine thread; a lane caller never sends through the
 * transport) and read by any thread: atomically, by both. The connections
 * (transport_state, shm rings, scratch) belong to the engine thread, except for what the
 * transport table says any thread may call (peer_state, shared_area, abort) and the
 * same-host lane's own areas (lane.c), which the calling threads use one at a time.
 * `broken` is read and written atomically by any thread.
 *
 * Errors travel as a status code, with the words in the record (rs_error_t, status.h)
 * of the actor that failed. The records, and which thread writes each:
 *  - the communicator's `error`: any thread (the engine thread, a caller on the
 *    same-host lane, an abort) through rs_fail, under error_mu; read whole with
 *    rs_comm_error (also under error_mu), or by the caller of the call that failed
 *    (rs_comm_last_error).
 *  - the engine's `error` (engine.h): usage errors and failed waits, written only by the
 *    threads that call the engine (submit.c), under the engine's mutex; never by the
 *    engine thread. The engine's `failure` (the first fatal error, which every later
 *    request fails with) is written once, by whichever thread fails the engine, also
 *    under the mutex.
 *  - the lane's `error` (lane.c): the thread that holds the lane's lock (the executor's
 *    staged instance belongs to the engine thread alone, without the lock). The calling
 *    side (submit.c) copies it before it lets the lane go, then fails the engine or
 *    writes the engine's `error`.
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
    const struct rs_transport *transport;
    void *transport_state;
    char **host_names; /* per rank, for error messages */
    int broken;        /* atomic: set by rs_fail for recoverable errors, never cleared */
    /* atomic: the first peer this rank found lost (rs_note_lost; -1: none). Its abort
     * notices name it, so that ranks with no connection to it can name it too. */
    int lost_rank;
    pthread_mutex_t error_mu; /* one writer (or whole-record reader) of `error` at a time */
    rs_error_t error;         /* the last failure, in words (rs_fail) */
    void *scratch; /* grows on demand; owned by the communicator, not global */
    size_t scratch_bytes;
    int wake_fd; /* an engine's self-pipe, polled while idle (-1: none) */
    int engine_attached;
    int transport_mode;  /* RS_TRANSPORT_*: what rs_comm_connect sets up */
    struct rs_shm *shm;  /* the shared-memory rings, or NULL */
    double spin_seconds; /* how long a shared-memory wait spins before it blocks */
    /* ... and how long while a calling thread is blocked waiting for the engine: that
     * thread's core is idle then, so the engine's waits for its peers need not pay a
     * wake-up (the lane's spin time) */
    double waiting_spin_seconds;
    int callers_waiting; /* threads blocked in rs_engine_wait */
    size_t small_allreduce_bytes; /* up to this size, allreduce exchanges whole buffers */
    size_t small_gather_bytes;    /* allgathers up to this total take log2(N) rounds */
    rs_topology_t topology;       /* hosts and the hierarchical allreduce's groups */
    int hierarchical_mode;        /* RS_HIERARCHICAL_*: when allreduce goes hierarchical */
    size_t hierarchical_min_bytes; /* auto: from this size on */
    int deterministic; /* reductions only in rank order (rs_comm_set_deterministic) */
    /* Bytes sent to each peer since connecting (not the setup), by how they went: the
     * first `size` entries through TCP, the next `size` through shared-memory rings. */
    int64_t *traffic;
    int count_traffic; /* set once setup is over: its exchanges are not traffic */
};

#endif
