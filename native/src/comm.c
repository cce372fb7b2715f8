/* Communicator lifecycle: create (listen), connect (TCP, then shared memory with same-host
 * peers), settings, abort and destroy. The one place that picks transports by name. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "topology.h"
#include "transport_shm.h"
#include "transport_tcp.h"

/* Until a communicator exists there is no record to word a failure in: bad arguments and
 * no memory for the communicator itself return their codes alone (the caller, which
 * passed the arguments, words them). From the listen on, failures are recorded. */
rs_status_t rs_comm_create(int rank, int size, const char *bind_host, double timeout_seconds,
                           double setup_seconds, rs_comm_t **out_comm, int *out_port) {
    if (size < 1 || rank < 0 || rank >= size || !out_comm || !out_port ||
        !(timeout_seconds >= 0) || !(setup_seconds > 0))
        return RS_ERR_USAGE;
    rs_comm_t *comm = calloc(1, sizeof *comm);
    if (!comm)
        return RS_ERR_NOMEM;
    pthread_mutex_init(&comm->error_mu, NULL);
    comm->rank = rank;
    comm->size = size;
    comm->timeout_seconds = timeout_seconds;
    comm->setup_seconds = setup_seconds;
    comm->transport = &rs_tcp_transport;
    comm->wake_fd = -1;
    comm->lost_rank = -1;
    comm->small_gather_bytes = RS_SMALL_GATHER_BYTES;
    comm->hierarchical_mode = RS_HIERARCHICAL_AUTO;
    comm->hierarchical_min_bytes = (size_t)1 << 20; /* ringsync/config.py's default */
    comm->host_names = calloc((size_t)size, sizeof *comm->host_names);
    comm->traffic = calloc(2 * (size_t)size, sizeof *comm->traffic);
    if (!comm->host_names || !comm->traffic) {
        free(comm->host_names);
        free(comm->traffic);
        pthread_mutex_destroy(&comm->error_mu);
        free(comm);
        return RS_ERR_NOMEM;
    }
    *out_comm = comm;
    return comm->transport->listen(comm, bind_host ? bind_host : "", out_port);
}

/* Shared-memory setup exchanges over the new connections: it is still setup, bounded by
 * the setup deadline even where the collectives have no limit (a peer that hangs in init()
 * must not hang the others forever). Single-threaded here: no engine yet. */
static rs_status_t connect_shm(rs_comm_t *comm) {
    if (comm->transport_mode == RS_TRANSPORT_TCP || comm->size == 1)
        return RS_OK;
    double limit = comm->timeout_seconds;
    comm->timeout_seconds = comm->setup_seconds;
    rs_status_t st = rs_shm_setup(comm, comm->transport_mode == RS_TRANSPORT_SHM);
    comm->timeout_seconds = limit;
    return st;
}

rs_status_t rs_comm_connect(rs_comm_t *comm, const char **hosts, const int *ports,
                            const char **host_names, uint64_t job_id,
                            const unsigned char *secret, size_t secret_len) {
    if (!secret || secret_len < 16 || secret_len > RS_SECRET_MAX)
        return rs_fail(comm, RS_ERR_USAGE, "the job secret must have 16 to %d bytes, not %zu",
                       RS_SECRET_MAX, secret_len);
    comm->job_id = job_id;
    memcpy(comm->secret, secret, secret_len);
    comm->secret_len = secret_len;
    for (int i = 0; i < comm->size; i++) {
        free(comm->host_names[i]);
        comm->host_names[i] = strdup(host_names && host_names[i] ? host_names[i] : hosts[i]);
        if (!comm->host_names[i])
            return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    }
    RS_CHECK(rs_topology_build(comm));
    unsigned char *eager = malloc((size_t)comm->size);
    if (!eager)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rs_status_t st = rs_topology_partners(comm, eager);
    if (st == RS_OK)
        st = comm->transport->connect(comm, hosts, ports, eager);
    free(eager);
    RS_CHECK(st);
    RS_CHECK(connect_shm(comm));
    comm->count_traffic = 1; /* from here on, what moves is the collectives' */
    return RS_OK;
}

rs_status_t rs_comm_set_transport(rs_comm_t *comm, int mode) {
    if (mode != RS_TRANSPORT_AUTO && mode != RS_TRANSPORT_TCP && mode != RS_TRANSPORT_SHM)
        return rs_fail(comm, RS_ERR_USAGE, "unknown transport mode %d", mode);
    comm->transport_mode = mode;
    return RS_OK;
}

rs_status_t rs_comm_set_spin(rs_comm_t *comm, double seconds) {
    if (!(seconds >= 0 && seconds <= 1))
        return rs_fail(comm, RS_ERR_USAGE, "spin time %g s is not between 0 and 1 s", seconds);
    comm->spin_seconds = seconds;
    return RS_OK;
}

rs_status_t rs_comm_set_small_allreduce(rs_comm_t *comm, size_t bytes) {
    comm->small_allreduce_bytes = bytes;
    return RS_OK;
}

rs_status_t rs_comm_set_small_gather(rs_comm_t *comm, size_t bytes) {
    comm->small_gather_bytes = bytes;
    return RS_OK;
}

rs_status_t rs_comm_set_hierarchical(rs_comm_t *comm, int mode, size_t min_bytes) {
    if (mode != RS_HIERARCHICAL_OFF && mode != RS_HIERARCHICAL_ON && mode != RS_HIERARCHICAL_AUTO)
        return rs_fail(comm, RS_ERR_USAGE, "unknown hierarchical allreduce mode %d", mode);
    comm->hierarchical_mode = mode;
    comm->hierarchical_min_bytes = min_bytes;
    return RS_OK;
}

rs_status_t rs_comm_set_deterministic(rs_comm_t *comm, int on) {
    comm->deterministic = on != 0;
    return RS_OK;
}

int rs_comm_callers_waiting(const rs_comm_t *comm) {
    return __atomic_load_n(&comm->callers_waiting, __ATOMIC_RELAXED);
}

rs_status_t rs_comm_traffic(const rs_comm_t *comm, int64_t *tcp_bytes, int64_t *shm_bytes) {
    if (!tcp_bytes || !shm_bytes)
        return RS_ERR_USAGE; /* (a read-only look at comm: no record to write) */
    for (int p = 0; p < comm->size; p++) {
        tcp_bytes[p] = __atomic_load_n(&comm->traffic[RS_VIA_TCP * comm->size + p],
                                       __ATOMIC_RELAXED);
        shm_bytes[p] = __atomic_load_n(&comm->traffic[RS_VIA_SHM * comm->size + p],
                                       __ATOMIC_RELAXED);
    }
    return RS_OK;
}

const char *rs_comm_transport_name(const rs_comm_t *comm) { return comm->transport->name; }

rs_status_t rs_comm_abort(rs_comm_t *comm) {
    if (comm->transport_state)
        comm->transport->abort(comm);
    if (!rs_comm_is_broken(comm))
        rs_fail(comm, RS_ERR_COMM, "communicator aborted on rank %d", comm->rank);
    return RS_OK;
}

void rs_comm_destroy(rs_comm_t *comm) {
    if (!comm)
        return;
    if (rs_comm_is_broken(comm) && comm->transport_state)
        comm->transport->abort(comm); /* tell peers we abort, rather than died */
    comm->transport->close(comm);
    for (int i = 0; i < comm->size; i++)
        free(comm->host_names[i]);
    free(comm->host_names);
    rs_topology_free(&comm->topology);
    free(comm->traffic);
    free(comm->scratch);
    pthread_mutex_destroy(&comm->error_mu);
    free(comm);
}
