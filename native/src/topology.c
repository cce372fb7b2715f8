/* Where the ranks sit: hosts, and each rank's place on its host, from the host names the
 * ranks reported. Computed once when the communicator connects, then fixed: every rank
 * computes it from the same list of names, so all agree on the groups the hierarchical
 * allreduce (hierarchical.c) runs over without exchanging anything. */
#include <stdlib.h>
#include <string.h>

#include "topology.h"

void rs_topology_free(rs_topology_t *t) {
    free(t->local_ranks);
    free(t->cross_ranks);
    free(t->host_ranks);
    memset(t, 0, sizeof *t);
}

/* Hosts are numbered in the order of their lowest rank (host[r]); a host's ranks in rank
 * order (index[r]); count[h] ranks are on host h. Returns the number of hosts. Quadratic
 * in the rank count, once at setup: a thousand ranks cost half a million compares. */
static int number_hosts(const rs_comm_t *comm, int *host, int *index, int *count) {
    int hosts = 0;
    for (int r = 0; r < comm->size; r++) {
        int first = 0;
        while (first < r && strcmp(comm->host_names[first], comm->host_names[r]) != 0)
            first++;
        host[r] = first == r ? hosts++ : host[first];
        index[r] = count[host[r]]++;
    }
    return hosts;
}

/* The hierarchical allreduce pairs local index i of every host: that needs at least two
 * hosts with the same number of ranks, and at least two per host (with one per host it
 * would be the flat ring anyway). */
static int uniform(const int *count, int hosts) {
    if (hosts < 2 || count[0] < 2)
        return 0;
    for (int h = 1; h < hosts; h++)
        if (count[h] != count[0])
            return 0;
    return 1;
}

/* The groups of a uniform layout: this host's ranks, and the ranks with my local index
 * on every host, each in ring order (rank order, host order); and every host's ranks. */
static rs_status_t fill_groups(rs_comm_t *comm, const int *host, const int *index, int hosts,
                               int local_size) {
    rs_topology_t *t = &comm->topology;
    t->local_ranks = malloc((size_t)local_size * sizeof *t->local_ranks);
    t->cross_ranks = malloc((size_t)hosts * sizeof *t->cross_ranks);
    t->host_ranks = malloc((size_t)comm->size * sizeof *t->host_ranks);
    if (!t->local_ranks || !t->cross_ranks || !t->host_ranks) {
        rs_topology_free(t);
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    }
    int me = comm->rank;
    for (int r = 0; r < comm->size; r++) {
        t->host_ranks[host[r] * local_size + index[r]] = r;
        if (host[r] == host[me])
            t->local_ranks[index[r]] = r;
        if (index[r] == index[me])
            t->cross_ranks[host[r]] = r;
    }
    t->hosts = hosts;
    t->local_size = local_size;
    t->local_index = index[me];
    t->cross_index = host[me];
    t->hierarchical = 1;
    return RS_OK;
}

rs_status_t rs_topology_build(rs_comm_t *comm) {
    rs_topology_free(&comm->topology);
    size_t n = (size_t)comm->size;
    int *host = malloc(n * sizeof *host), *index = malloc(n * sizeof *index);
    int *count = calloc(n, sizeof *count);
    rs_status_t st = RS_OK;
    if (!host || !index || !count) {
        st = rs_fail(comm, RS_ERR_NOMEM, "out of memory");
        goto out;
    }
    int hosts = number_hosts(comm, host, index, count);
    comm->topology.hosts = hosts;
    if (uniform(count, hosts))
        st = fill_groups(comm, host, index, hosts, count[0]);
out:
    free(host);
    free(index);
    free(count);
    return st;
}

/* ---- the partners the algorithms need ---- */

static int is_power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

/* Flag ranks[i]'s log-round partners among ranks[0..n): recursive doubling (i ^ d) for a
 * power-of-two n, else Bruck's (i +- d) (gather_log.c, the barrier, shared-memory setup);
 * for any n also the recursive doubling of the largest power of two below it, and its
 * fold of the ranks past it (the small allreduce, the small broadcast). */
static void flag_log_partners(const int *ranks, int n, int i, unsigned char *flags) {
    int p2 = 1;
    while (p2 * 2 <= n)
        p2 *= 2;
    for (int d = 1; d < n; d *= 2) {
        if (is_power_of_two(n)) {
            flags[ranks ? ranks[i ^ d] : i ^ d] = 1;
            continue;
        }
        flags[ranks ? ranks[(i + d) % n] : (i + d) % n] = 1;
        flags[ranks ? ranks[(i - d % n + n) % n] : (i - d % n + n) % n] = 1;
        if (d < p2 && i < p2)
            flags[ranks ? ranks[i ^ d] : i ^ d] = 1;
        if (d > n / 2)
            break;
    }
    if (!is_power_of_two(n) && (i >= p2 || i + p2 < n))
        flags[ranks ? ranks[i >= p2 ? i - p2 : i + p2] : (i >= p2 ? i - p2 : i + p2)] = 1;
}

static void flag_ring_neighbours(const int *ranks, int n, int i, unsigned char *flags) {
    if (n < 2)
        return;
    flags[ranks ? ranks[(i + 1) % n] : (i + 1) % n] = 1;
    flags[ranks ? ranks[(i + n - 1) % n] : (i + n - 1) % n] = 1;
}

/* This host's ranks in rank order (their local index), as the shared-memory setup sees
 * them; *me: my place. */
static int *host_ranks_of(const rs_comm_t *comm, int *count, int *me) {
    int *ranks = malloc((size_t)comm->size * sizeof *ranks);
    *count = 0;
    for (int r = 0; ranks && r < comm->size; r++) {
        if (strcmp(comm->host_names[r], comm->host_names[comm->rank]) != 0)
            continue;
        if (r == comm->rank)
            *me = *count;
        ranks[(*count)++] = r;
    }
    return ranks;
}

rs_status_t rs_topology_partners(rs_comm_t *comm, unsigned char *flags) {
    const rs_topology_t *t = &comm->topology;
    int local_count = 0, local_me = 0;
    int *local = host_ranks_of(comm, &local_count, &local_me);
    if (!local)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    memset(flags, 0, (size_t)comm->size);
    flag_ring_neighbours(NULL, comm->size, comm->rank, flags);
    flag_log_partners(NULL, comm->size, comm->rank, flags);
    flag_log_partners(local, local_count, local_me, flags);
    if (t->hierarchical) {
        flag_ring_neighbours(t->local_ranks, t->local_size, t->local_index, flags);
        flag_ring_neighbours(t->cross_ranks, t->hosts, t->cross_index, flags);
    }
    flags[comm->rank] = 0;
    free(local);
    return RS_OK;
}
