/* Shared-memory transport for peers on the same host, with TCP for the rest.
 *
 * Bytes to a same-host peer go through a single-producer single-consumer ring in shared
 * memory: each rank maps one segment holding a ring per peer that sends to it, and maps
 * its same-host peers' segments to send to them. The TCP connections stay, for peers on
 * other hosts and for everything that needs the kernel: noticing a peer's death (hangup)
 * or abort (urgent byte), and waking a rank that sleeps. A waiting rank spins on the ring
 * for a few microseconds (rs_comm_set_spin), then raises a "sleeping" flag and blocks in poll() on the
 * peer's socket; the peer, after moving bytes, sends one doorbell byte only when it sees
 * that flag. So a busy exchange makes no system calls and an idle rank uses no CPU.
 *
 * Segments are named after the job's public id and the rank, created exclusively, and
 * unlinked as soon as every same-host peer has mapped them: nothing stays in /dev/shm,
 * even if the job is killed later. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define RING_BYTES ((uint64_t)1 << 21) /* per sending peer: 2 MiB */
#define DOORBELL 'D'

typedef struct {
    uint64_t head; /* bytes the producer has written, ever (written by the producer) */
    char pad0[56];
    uint64_t tail; /* bytes the consumer has taken, ever (written by the consumer) */
    char pad1[56];
    int consumer_sleeping; /* the consumer blocks until a doorbell */
    char pad2[60];
    int producer_sleeping; /* the producer (ring full) blocks until a doorbell */
    char pad3[60];
} ring_header_t;

typedef struct {
    ring_header_t header;
    char data[RING_BYTES];
} ring_t;

struct rs_shm {
    ring_t *mine;       /* my segment: ring p holds bytes from rank p */
    ring_t **theirs;    /* per peer: its segment (NULL if not same-host) */
    unsigned char *local; /* per peer: 1 if it is reached through shared memory */
    size_t segment_bytes;
    char name[64];
    int unlinked;
};

static int is_local(const rs_comm_t *comm, int peer) {
    return comm->shm && peer >= 0 && comm->shm->local[peer];
}

/* ---- setup ---- */

static rs_status_t sys_fail(rs_comm_t *comm, const char *what, const char *name) {
    return rs_fail(comm, RS_ERR_SYSTEM, "rank %d: %s %s: %s (shared-memory transport; "
                   "RINGSYNC_TRANSPORT=tcp avoids it)", comm->rank, what, name, strerror(errno));
}

static void segment_name(char *out, size_t len, uint64_t job_id, int rank) {
    snprintf(out, len, "/ringsync-%016llx-%d", (unsigned long long)job_id, rank);
}

static rs_status_t map_segment(rs_comm_t *comm, const char *name, int create, size_t bytes,
                               ring_t **out) {
    int fd = shm_open(name, create ? O_CREAT | O_EXCL | O_RDWR : O_RDWR, 0600);
    if (fd < 0)
        return sys_fail(comm, create ? "cannot create" : "cannot open", name);
    void *p = MAP_FAILED;
    if (!create || ftruncate(fd, (off_t)bytes) == 0)
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int saved = errno;
    close(fd);
    if (p == MAP_FAILED) {
        if (create)
            shm_unlink(name); /* created here, never to be used */
        errno = saved;
        return sys_fail(comm, "cannot size or map", name);
    }
    *out = p;
    return RS_OK;
}

/* One byte to and from every same-host peer over TCP: a barrier among them. */
static rs_status_t local_barrier(rs_comm_t *comm) {
    int n = 0;
    rs_xfer_t *xfers = calloc(2 * (size_t)comm->size, sizeof *xfers);
    char *bytes = calloc(2 * (size_t)comm->size, 1);
    if (!xfers || !bytes) {
        free(xfers);
        free(bytes);
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    }
    for (int p = 0; p < comm->size; p++) {
        if (!comm->shm->local[p])
            continue;
        xfers[n++] = (rs_xfer_t){.peer = p, .is_send = 1, .buf = &bytes[2 * p], .len = 1};
        xfers[n++] = (rs_xfer_t){.peer = p, .is_send = 0, .buf = &bytes[2 * p + 1], .len = 1};
    }
    rs_status_t st = rs_progress(comm, xfers, n);
    free(xfers);
    free(bytes);
    return st;
}

static void shm_release(rs_comm_t *comm) {
    struct rs_shm *shm = comm->shm;
    if (!shm)
        return;
    if (shm->mine && !shm->unlinked) /* ours only: a failed O_EXCL create is someone else's */
        shm_unlink(shm->name);
    for (int p = 0; shm->theirs && p < comm->size; p++)
        if (shm->theirs[p])
            munmap(shm->theirs[p], shm->segment_bytes);
    if (shm->mine)
        munmap(shm->mine, shm->segment_bytes);
    free(shm->theirs);
    free(shm->local);
    free(shm);
    comm->shm = NULL;
}

static rs_status_t map_peers(rs_comm_t *comm) {
    struct rs_shm *shm = comm->shm;
    RS_CHECK(map_segment(comm, shm->name, 1, shm->segment_bytes, &shm->mine));
    RS_CHECK(local_barrier(comm)); /* every segment exists */
    for (int p = 0; p < comm->size; p++) {
        if (!shm->local[p])
            continue;
        char name[64];
        segment_name(name, sizeof name, comm->job_id, p);
        RS_CHECK(map_segment(comm, name, 0, shm->segment_bytes, &shm->theirs[p]));
    }
    RS_CHECK(local_barrier(comm)); /* every segment is mapped by all who need it */
    shm_unlink(shm->name);
    shm->unlinked = 1;
    return RS_OK;
}

static int same_host(const rs_comm_t *comm, int peer) {
    return peer != comm->rank &&
           strcmp(rs_peer_host(comm, peer), rs_peer_host(comm, comm->rank)) == 0;
}

rs_status_t rs_shm_setup(rs_comm_t *comm, int required) {
    int any = 0;
    for (int p = 0; p < comm->size; p++) {
        if (required && p != comm->rank && !same_host(comm, p))
            return rs_fail(comm, RS_ERR_USAGE, "RINGSYNC_TRANSPORT=shm, but rank %d is on host "
                           "%s, not on %s with rank %d", p, rs_peer_host(comm, p),
                           rs_peer_host(comm, comm->rank), comm->rank);
        any |= same_host(comm, p);
    }
    if (!any)
        return RS_OK;
    struct rs_shm *shm = calloc(1, sizeof *shm);
    if (!shm)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    comm->shm = shm;
    shm->theirs = calloc((size_t)comm->size, sizeof *shm->theirs);
    shm->local = calloc((size_t)comm->size, 1);
    if (!shm->theirs || !shm->local) {
        shm_release(comm);
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    }
    for (int p = 0; p < comm->size; p++)
        shm->local[p] = (unsigned char)same_host(comm, p);
    /* Rings are indexed by sending rank; pages of unused ones are never touched. The
     * same-host fast lane's area (direct.c) follows them. */
    shm->segment_bytes = (size_t)comm->size * sizeof(ring_t) + RS_DIRECT_AREAS * RS_DIRECT_AREA_BYTES;
    segment_name(shm->name, sizeof shm->name, comm->job_id, comm->rank);
    /* The setup barriers run over TCP: the hybrid table is installed only after. */
    rs_status_t st = map_peers(comm);
    if (st != RS_OK) {
        shm_release(comm);
        return st;
    }
    comm->transport = &rs_shm_transport;
    return RS_OK;
}

/* ---- the fast lane's areas ---- */

int rs_shm_all_local(const rs_comm_t *comm) {
    for (int p = 0; p < comm->size; p++)
        if (p != comm->rank && !is_local(comm, p))
            return 0;
    return comm->shm != NULL;
}

void *rs_shm_direct_area(rs_comm_t *comm, int rank, int area) {
    ring_t *segment = rank == comm->rank ? comm->shm->mine : comm->shm->theirs[rank];
    return (char *)segment + (size_t)comm->size * sizeof(ring_t) +
           (size_t)area * RS_DIRECT_AREA_BYTES;
}

/* ---- the rings ---- */

static ring_t *ring_to(rs_comm_t *comm, int peer) { return &comm->shm->theirs[peer][comm->rank]; }
static ring_t *ring_from(rs_comm_t *comm, int peer) { return &comm->shm->mine[peer]; }

static void ring_doorbell(rs_comm_t *comm, int peer, int *sleeping) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleeping, __ATOMIC_RELAXED)) {
        __atomic_store_n(sleeping, 0, __ATOMIC_RELAXED);
        char bell = DOORBELL;
        size_t done = 0;
        /* Unchecked on purpose: a full socket already holds a bell, and a broken one is
         * reported by the next poll or transfer on that peer. */
        rs_tcp_transport.send(comm, peer, &bell, 1, &done);
    }
}

static void copy_ring(char *dst, const char *src, uint64_t pos, size_t n, int into_ring) {
    size_t at = (size_t)(pos % RING_BYTES);
    size_t first = n < RING_BYTES - at ? n : RING_BYTES - at;
    if (into_ring) {
        memcpy(dst + at, src, first);
        memcpy(dst, src + first, n - first);
    } else {
        memcpy(dst, src + at, first);
        memcpy(dst + first, src, n - first);
    }
}

static rs_status_t shm_send(rs_comm_t *comm, int peer, const char *buf, size_t len,
                            size_t *done) {
    if (!is_local(comm, peer))
        return rs_tcp_transport.send(comm, peer, buf, len, done);
    ring_t *r = ring_to(comm, peer);
    uint64_t head = r->header.head; /* only we write it */
    uint64_t tail = __atomic_load_n(&r->header.tail, __ATOMIC_ACQUIRE);
    size_t room = (size_t)(RING_BYTES - (head - tail));
    size_t n = len - *done < room ? len - *done : room;
    if (n == 0)
        return RS_OK;
    copy_ring(r->data, buf + *done, head, n, 1);
    __atomic_store_n(&r->header.head, head + n, __ATOMIC_RELEASE);
    *done += n;
    ring_doorbell(comm, peer, &r->header.consumer_sleeping);
    return RS_OK;
}

static rs_status_t shm_recv(rs_comm_t *comm, int peer, char *buf, size_t len, size_t *done) {
    if (!is_local(comm, peer))
        return rs_tcp_transport.recv(comm, peer, buf, len, done);
    ring_t *r = ring_from(comm, peer);
    uint64_t tail = r->header.tail;
    uint64_t head = __atomic_load_n(&r->header.head, __ATOMIC_ACQUIRE);
    size_t n = len - *done < head - tail ? len - *done : (size_t)(head - tail);
    if (n == 0)
        return RS_OK;
    copy_ring(buf + *done, r->data, tail, n, 0);
    __atomic_store_n(&r->header.tail, tail + n, __ATOMIC_RELEASE);
    *done += n;
    ring_doorbell(comm, peer, &r->header.producer_sleeping);
    return RS_OK;
}

/* Whether a wait on a same-host peer can progress now; raising `sleep` first marks us
 * as blocked, so that the peer rings the doorbell after its next move. */
static int shm_ready(rs_comm_t *comm, const rs_wait_t *w, int sleep) {
    int ready = 0;
    if (w->want_read) {
        ring_t *r = ring_from(comm, w->peer);
        if (sleep)
            __atomic_store_n(&r->header.consumer_sleeping, 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        ready |= __atomic_load_n(&r->header.head, __ATOMIC_ACQUIRE) != r->header.tail;
    }
    if (w->want_write) {
        ring_t *r = ring_to(comm, w->peer);
        if (sleep)
            __atomic_store_n(&r->header.producer_sleeping, 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        ready |= r->header.head - __atomic_load_n(&r->header.tail, __ATOMIC_ACQUIRE) < RING_BYTES;
    }
    return ready;
}

static int mark_shm_ready(rs_comm_t *comm, rs_wait_t *waits, int n, int sleep) {
    int any = 0;
    for (int k = 0; k < n; k++)
        if (is_local(comm, waits[k].peer)) {
            waits[k].ready = shm_ready(comm, &waits[k], sleep);
            any |= waits[k].ready;
        }
    return any;
}

static rs_status_t drain_doorbells(rs_comm_t *comm, int peer) {
    char bells[64];
    size_t done;
    do {
        done = 0;
        RS_CHECK(rs_tcp_transport.recv(comm, peer, bells, sizeof bells, &done));
    } while (done == sizeof bells);
    return RS_OK;
}

static rs_status_t shm_poll(rs_comm_t *comm, rs_wait_t *waits, int n, int timeout_ms,
                            int *lost_peer) {
    *lost_peer = -1;
    for (int k = 0; k < n; k++)
        waits[k].ready = 0;
    double spin_until = rs_now() + comm->spin_seconds;
    do {
        if (mark_shm_ready(comm, waits, n, 0))
            return RS_OK;
    } while (rs_now() < spin_until);
    if (mark_shm_ready(comm, waits, n, 1))
        return RS_OK; /* a stale sleeping flag only costs the peer one doorbell */
    /* Block: a same-host wait becomes a wait for its doorbell on the peer's socket. */
    rs_wait_t stack_waits[16];
    rs_wait_t *socket_waits = n <= 16 ? stack_waits : malloc((size_t)n * sizeof *socket_waits);
    if (!socket_waits)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    for (int k = 0; k < n; k++) {
        socket_waits[k] = waits[k];
        if (is_local(comm, waits[k].peer))
            socket_waits[k].want_read = 1, socket_waits[k].want_write = 0;
    }
    rs_status_t st = rs_tcp_transport.poll(comm, socket_waits, n, timeout_ms, lost_peer);
    for (int k = 0; st == RS_OK && k < n; k++) {
        if (!is_local(comm, waits[k].peer)) {
            waits[k].ready = socket_waits[k].ready;
            continue;
        }
        if (socket_waits[k].ready)
            st = drain_doorbells(comm, waits[k].peer);
    }
    if (socket_waits != stack_waits)
        free(socket_waits);
    RS_CHECK(st);
    mark_shm_ready(comm, waits, n, 0);
    return RS_OK;
}

static void shm_abort(rs_comm_t *comm) { rs_tcp_transport.abort(comm); }

static int shm_peer_aborted(rs_comm_t *comm, int peer) {
    return rs_tcp_transport.peer_aborted(comm, peer);
}

static void shm_close(rs_comm_t *comm) {
    shm_release(comm);
    rs_tcp_transport.close(comm);
}

const rs_transport_t rs_shm_transport = {
    .name = "shm",
    .listen = NULL, /* installed by rs_shm_setup, once TCP has connected */
    .connect = NULL,
    .send = shm_send,
    .recv = shm_recv,
    .poll = shm_poll,
    .abort = shm_abort,
    .close = shm_close,
    .peer_aborted = shm_peer_aborted,
};
