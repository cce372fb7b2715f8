/* Hierarchical allreduce: topology-aware, for communicators spanning several hosts.
 *
 * A flat ring over all ranks crosses each host boundary with one rank's whole share of
 * the traffic: on 2 hosts of 2 ranks, the one link out of a host carries 1.5x the buffer.
 * Here the L ranks of each host first reduce-scatter the buffer among themselves (over
 * shared memory), so that local index i holds its host's sum of block i; then the ranks
 * of local index i on the H hosts allreduce that block in a ring of their own, all L such
 * rings at once, so that every rank's link is busy, each carrying 2(H-1)/H of a block
 * of S/L bytes (the link bound 2(H-1)/H * S per host); then each host allgathers the
 * reduced blocks. Every element is reduced in exactly one place and copied from there,
 * so every rank ends with the same bits. */
#include <stdlib.h>

#include "internal.h"

static rs_group_t local_group(const rs_topology_t *t) {
    return (rs_group_t){t->local_ranks, t->local_size, t->local_index};
}

static rs_group_t cross_group(const rs_topology_t *t) {
    return (rs_group_t){t->cross_ranks, t->hosts, t->cross_index};
}

int rs_hierarchical_chosen(const rs_comm_t *comm, size_t bytes) {
    if (!comm->topology.hierarchical || comm->hierarchical_mode == RS_HIERARCHICAL_OFF)
        return 0;
    return comm->hierarchical_mode == RS_HIERARCHICAL_ON || bytes >= comm->hierarchical_min_bytes;
}

rs_status_t rs_hierarchical_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                      rs_reduce_fn fn) {
    const rs_topology_t *t = &comm->topology;
    rs_group_t local = local_group(t), cross = cross_group(t);
    rs_blocks_t blocks;
    RS_CHECK(rs_blocks_even(comm, count, t->local_size, elem, &blocks));
    char *mine = buf + blocks.offset[t->local_index];
    size_t my_count = blocks.bytes[t->local_index] / elem;
    rs_status_t st;
    RS_CHECK_GOTO(rs_ring_reduce_scatter(comm, &local, buf, &blocks, elem, fn), st, out);
    RS_CHECK_GOTO(rs_ring_allreduce(comm, &cross, mine, my_count, elem, fn), st, out);
    st = rs_ring_allgather(comm, &local, buf, &blocks);
out:
    free(blocks.bytes);
    return st;
}
