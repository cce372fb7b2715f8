/* The same-host lane (lane.c): blocking collectives through shared memory on the calling
 * thread, when every rank is on this host, and the staged allreduce through the same
 * areas that the engine's executor runs. */
#ifndef RINGSYNC_LANE_H
#define RINGSYNC_LANE_H

#include <stddef.h>
#include <stdint.h>

#include "checked.h"
#include "comm.h"

typedef struct rs_lane rs_lane_t;

/* NULL unless every rank of comm is on this host (shared memory) and there are several. */
rs_lane_t *rs_lane_create(rs_comm_t *comm, int area, double spin_seconds,
                          double stall_seconds, size_t max_bytes);
void rs_lane_free(rs_lane_t *lane);
/* One thread at a time runs a lane operation: the caller holds the lane from before
 * rs_lane_run until it has read rs_lane_error. */
void rs_lane_lock(rs_lane_t *lane);
void rs_lane_unlock(rs_lane_t *lane);
/* Why the lane's last operation failed; code RS_OK when the failure was not the lane's to
 * word (the engine's failure, or the communicator's record). */
const rs_error_t *rs_lane_error(const rs_lane_t *lane);
/* Post, wait for every rank's post, check agreement and, for a small allreduce, reduce.
 * *ran = 0: every rank found that the engine must run it (too large, another kind). A
 * non-zero *failure (the engine's, read atomically) ends the wait with that status. */
rs_status_t rs_lane_run(rs_lane_t *lane, const char *name, const rs_meta_t *meta,
                        size_t count, const void *sendbuf, void *recvbuf,
                        const rs_status_t *failure, uint32_t epoch, int *ran);
/* Allreduce through the shared segments in chunks: each rank reduces its slice of every
 * rank's chunk, then copies the others' reduced slices (one thread per rank, in an order
 * the ranks agreed on: the engine's executor, after negotiation, on an instance that only
 * the engine thread uses, so without the lock). */
rs_status_t rs_lane_staged_allreduce(rs_lane_t *lane, const void *sendbuf, void *recvbuf,
                                     size_t count, const rs_meta_t *meta);
/* Post a refusal of the blocking call `name` of `kind` in its place in the call order
 * (the peers' same call fails naming this rank and quoting `reason`), then wait until
 * every rank has posted that call. The caller holds the lane's lock. */
rs_status_t rs_lane_refuse(rs_lane_t *lane, const char *name, int kind, const char *reason,
                           const rs_status_t *failure, uint32_t epoch);
/* A joined rank, until *done (read atomically) or `until` (rs_now() time): post zeros for
 * every allreduce the others post during join number `epoch` (posts carry the poster's
 * count of completed joins: one made after the join completed is left for this rank's own
 * next call). Takes the lane a slice at a time. */
void rs_lane_serve_joined(rs_lane_t *lane, const int *done, uint32_t epoch, double until);

/* Stall reports this lane has made (any thread). */
uint64_t rs_lane_stalls(const rs_lane_t *lane);
/* The named blocking call this rank waits in on the lane: 1 and its name, kind, start and
 * which ranks have posted it (size entries), or 0 when it waits in none. Any thread. */
int rs_lane_waiting(rs_lane_t *lane, char *name, size_t cap, int *kind, double *since,
                    unsigned char *posted_by);

#endif
