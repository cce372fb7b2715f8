/* Shared-memory transport for peers on the same host, with TCP for the rest.
 *
 * Bytes to a same-host peer go through a single-producer single-consumer ring in shared
 * memory: each rank maps one segment holding a ring per other rank on its host, and maps
 * its same-host peers' segments to send to them. The TCP connections stay, for peers on
 * other hosts and for everything that needs the kernel: noticing a peer's death (hangup)
 * or abort (urgent byte), and waking a rank that sleeps. A waiting rank spins on the ring
 * for a few microseconds (rs_comm_set_spin; the lane's spin time while a calling thread is
 * blocked waiting for the engine), then raises a "sleeping" flag and blocks in poll() on the
 * peer's socket; the peer, after moving bytes, sends one doorbell byte only when it sees
 * that flag. So a busy exchange makes no system calls and an idle rank uses no CPU.
 *
 * Segments are named after the job's public id, the rank and the creator's pid, created
 * exclusively, their pages reserved at once, and unlinked as soon as every same-host peer
 * has mapped them. A rank killed before that leaves its segment behind: the next job on
 * the host removes it (remove_orphans), and so do its peers if they got its name.
 *
 * Whether a host's ranks use shared memory is agreed among them: if one cannot create,
 * reserve or map a segment (a small /dev/shm), all fall back to TCP with each other (or,
 * with RINGSYNC_TRANSPORT=shm, all fail): a rank on shared memory would wait forever for
 * a peer that sends over TCP. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "progress.h"
#include "transport_shm.h"
#include "util.h"

#define RING_BYTES ((uint64_t)1 << 21) /* per sending peer: 2 MiB */
#define DOORBELL 'D'
#define SHM_DIR "/dev/shm" /* where shm_open keeps segments (glibc) */
#define NAME_PREFIX "ringsync-"
#define NAME_LEN 80

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

/* What same-host ranks tell each other at each setup barrier. */
typedef struct {
    int32_t error; /* 0, or the errno that stopped the sender's last setup step */
    int32_t pid;   /* names the sender's segment */
} hello_t;

struct rs_shm {
    ring_t *mine;     /* my segment: a ring per other rank on this host */
    ring_t **theirs;  /* per peer: its segment (NULL if not same-host) */
    ring_t **rx;      /* per peer: the ring it sends to me through (NULL: not same-host) */
    ring_t **tx;      /* per peer: the ring I send to it through */
    int *index;       /* per rank: its place among this host's ranks, or -1 */
    int *pids;        /* per same-host peer: its pid, once known (0: not known) */
    int local_size;   /* ranks on this host, me included */
    size_t segment_bytes;
    int fd;           /* my segment, created and not yet unlinked: holds a shared lock */
    char name[NAME_LEN];
    char why[512];    /* why this rank could not set up shared memory */
    const rs_transport_t *below; /* the transport under this one (TCP): other hosts,
                                    liveness, doorbells; reached through its table */
};

static int is_local(const rs_comm_t *comm, int peer) {
    return comm->shm && peer >= 0 && comm->shm->rx[peer];
}

/* ---- naming, and orphans of dead jobs ---- */

static void segment_name(char *out, size_t len, uint64_t job_id, int rank, int pid) {
    snprintf(out, len, "/" NAME_PREFIX "%016llx-%d-%d", (unsigned long long)job_id, rank, pid);
}

/* The pid that ends "ringsync-<16 hex digits>-<rank>-<pid>", or 0 for any other name
 * (Open MPI's files, segments of older versions). */
static long creator_pid(const char *entry) {
    const char *digits = "0123456789";
    size_t prefix = strlen(NAME_PREFIX);
    if (strncmp(entry, NAME_PREFIX, prefix) != 0)
        return 0;
    const char *s = entry + prefix;
    if (strspn(s, "0123456789abcdef") != 16 || s[16] != '-')
        return 0;
    s += 17;
    size_t rank_len = strspn(s, digits);
    if (rank_len == 0 || s[rank_len] != '-')
        return 0;
    s += rank_len + 1;
    size_t pid_len = strspn(s, digits);
    if (pid_len == 0 || pid_len > 9 || s[pid_len] != '\0')
        return 0;
    return strtol(s, NULL, 10);
}

/* Removes the segment unless a live process holds its lock. The pid alone is not enough
 * where containers share /dev/shm but not pids: there a live creator's pid can look dead
 * to us, but its lock shows. Unlinked while we hold the lock, so that nobody could have
 * taken it over in between. */
static void remove_if_unlocked(const char *entry) {
    char name[NAME_LEN];
    if (snprintf(name, sizeof name, "/%s", entry) >= (int)sizeof name)
        return;
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd < 0)
        return; /* gone already, or another user's (which we could not unlink anyway) */
    if (flock(fd, LOCK_EX | LOCK_NB) == 0)
        shm_unlink(name);
    close(fd);
}

/* Segments are unlinked once mapped, so any left in /dev/shm belong to ranks killed
 * during setup. One whose creator is gone (by the pid in its name) is removed: best
 * effort, a name we cannot read or remove is left alone. */
static void remove_orphans(void) {
    DIR *dir = opendir(SHM_DIR);
    if (!dir)
        return;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        long pid = creator_pid(e->d_name);
        if (pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH)
            remove_if_unlocked(e->d_name);
    }
    closedir(dir);
}

/* ---- setup ---- */

static double mib(double bytes) { return bytes / (1 << 20); }

/* "; /dev/shm: 1.2 of 64.0 MiB free", or nothing where it cannot be read. */
static void describe_space(char *out, size_t len) {
    struct statvfs vfs;
    out[0] = '\0';
    if (statvfs(SHM_DIR, &vfs) == 0)
        snprintf(out, len, "; %s: %.1f of %.1f MiB free", SHM_DIR,
                 mib((double)vfs.f_bavail * vfs.f_frsize), mib((double)vfs.f_blocks * vfs.f_frsize));
}

/* Records why this rank cannot use shared memory (for the warning or error); returns
 * the error, for the next barrier to carry. */
static int note(struct rs_shm *shm, int error, const char *what, const char *name) {
    char space[128];
    describe_space(space, sizeof space);
    snprintf(shm->why, sizeof shm->why, "cannot %s %s (%.1f MiB%s): %s", what, name,
             mib((double)shm->segment_bytes), space, strerror(error));
    return error;
}

/* Sizes the file and reserves its pages now: a full /dev/shm then fails here, instead of
 * killing a rank with SIGBUS when it first touches a page that tmpfs cannot supply.
 * posix_fallocate returns the error (it does not set errno); tmpfs gives up with EINTR
 * when a signal is pending. */
static int reserve(int fd, size_t bytes) {
    int error;
    RS_RETRY_EINTR_CODE(error, posix_fallocate(fd, 0, (off_t)bytes));
    return error;
}

/* The fd stays open, with a shared lock that tells orphan scans we are alive, until the
 * segment is unlinked. */
static int create_segment(struct rs_shm *shm) {
    shm->fd = shm_open(shm->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (shm->fd < 0)
        return note(shm, errno, "create", shm->name);
    struct stat st;
    if (flock(shm->fd, LOCK_SH) != 0 || fstat(shm->fd, &st) != 0)
        return note(shm, errno, "lock", shm->name);
    if (st.st_nlink == 0) /* a scan elsewhere took it for an orphan before we locked it */
        return note(shm, EAGAIN, "keep", shm->name);
    int error = reserve(shm->fd, shm->segment_bytes);
    if (error)
        return note(shm, error, "reserve", shm->name);
    void *p = mmap(NULL, shm->segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, shm->fd, 0);
    if (p == MAP_FAILED)
        return note(shm, errno, "map", shm->name);
    shm->mine = p;
    return 0;
}

static void unlink_mine(struct rs_shm *shm) {
    if (shm->fd < 0)
        return; /* not created (a failed O_EXCL create is someone else's), or unlinked */
    shm_unlink(shm->name);
    close(shm->fd);
    shm->fd = -1;
}

/* A peer's segment must be as large as ours: mapping more than the file holds would turn
 * into SIGBUS at the first touch past its end. */
static int map_peer(rs_comm_t *comm, int peer) {
    struct rs_shm *shm = comm->shm;
    char name[NAME_LEN];
    segment_name(name, sizeof name, comm->job_id, peer, shm->pids[peer]);
    int fd = shm_open(name, O_RDWR, 0600);
    if (fd < 0)
        return note(shm, errno, "open", name);
    struct stat st;
    void *p = MAP_FAILED;
    int error = fstat(fd, &st) != 0 ? errno : (size_t)st.st_size < shm->segment_bytes ? EINVAL : 0;
    if (!error && (p = mmap(NULL, shm->segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                            0)) == MAP_FAILED)
        error = errno;
    close(fd);
    if (error)
        return note(shm, error, "map", name);
    shm->theirs[peer] = p;
    return 0;
}

static int is_peer(const rs_comm_t *comm, int p) {
    return p != comm->rank && comm->shm->index[p] >= 0;
}

/* The lowest rank on this host whose hello carries an error (or -1), and that error. */
static int first_failed(const hello_t *all, const int *locals, int n, int *error) {
    for (int i = 0; i < n; i++) /* (local order is rank order) */
        if (all[i].error) {
            *error = all[i].error;
            return locals[i];
        }
    return -1;
}

/* One round of the hellos' gather: send `count` hellos from all[from] to local index
 * `to`, receive as many into all[into] from local index `source`. */
static rs_status_t swap_hellos(rs_comm_t *comm, const int *locals, hello_t *all, int to,
                               int from, int source, int into, int count) {
    rs_xfer_t x[2] = {rs_send_to(locals[to], (char *)&all[from], count * sizeof *all),
                      rs_recv_from(locals[source], (char *)&all[into], count * sizeof *all)};
    return rs_progress(comm, x, 2);
}

/* Every local rank's hello in all[local index], in ceil(log2 n) rounds over the host's
 * ranks: recursive doubling when n is a power of two (the partners of the collectives' log
 * rounds, so no extra connections), else Bruck's rounds over a rotated copy. */
static rs_status_t gather_hellos(rs_comm_t *comm, const int *locals, int n, int me,
                                 hello_t *all) {
    if ((n & (n - 1)) == 0) {
        for (int d = 1; d < n; d *= 2) {
            int mine = me & ~(d - 1), theirs = mine ^ d;
            RS_CHECK(swap_hellos(comm, locals, all, me ^ d, mine, me ^ d, theirs, d));
        }
        return RS_OK;
    }
    hello_t *rot = malloc((size_t)n * sizeof *rot); /* rot[i]: local index me + i's */
    if (!rot)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rot[0] = all[me];
    rs_status_t st = RS_OK;
    for (int d = 1; d < n && st == RS_OK; d *= 2)
        st = swap_hellos(comm, locals, rot, (me - d + n) % n, 0, (me + d) % n, d,
                         d < n - d ? d : n - d);
    for (int i = 0; st == RS_OK && i < n; i++)
        all[(me + i) % n] = rot[i];
    free(rot);
    return st;
}

/* A barrier among this host's ranks, over TCP: each tells every other its pid and how
 * its last step went (`error`, 0 if fine). Every rank sees the same hellos, so all agree
 * on *failed: the lowest rank that failed, or -1. The peers' pids are learned (their
 * segments can then be removed should a later step fail). */
static rs_status_t local_barrier(rs_comm_t *comm, int error, int *failed, int *failed_error) {
    struct rs_shm *shm = comm->shm;
    int n = shm->local_size, me = shm->index[comm->rank];
    int *locals = malloc((size_t)n * sizeof *locals);
    hello_t *all = calloc((size_t)n, sizeof *all);
    rs_status_t st = RS_OK;
    if (!locals || !all)
        RS_CHECK_GOTO(rs_fail(comm, RS_ERR_NOMEM, "out of memory"), st, out);
    for (int p = 0; p < comm->size; p++)
        if (shm->index[p] >= 0)
            locals[shm->index[p]] = p;
    all[me] = (hello_t){.error = error, .pid = (int32_t)getpid()};
    st = gather_hellos(comm, locals, n, me, all);
    for (int i = 0; i < n; i++) /* (even those of a failed gather that arrived) */
        if (i != me && all[i].pid > 0)
            shm->pids[locals[i]] = all[i].pid;
    if (st == RS_OK)
        *failed = first_failed(all, locals, n, failed_error);
out:
    free(locals);
    free(all);
    return st;
}

static void shm_release(rs_comm_t *comm) {
    struct rs_shm *shm = comm->shm;
    if (!shm)
        return;
    unlink_mine(shm);
    for (int p = 0; shm->theirs && p < comm->size; p++)
        if (shm->theirs[p])
            munmap(shm->theirs[p], shm->segment_bytes);
    if (shm->mine)
        munmap(shm->mine, shm->segment_bytes);
    free(shm->theirs);
    free(shm->rx);
    free(shm->tx);
    free(shm->index);
    free(shm->pids);
    free(shm);
    comm->shm = NULL;
}

/* Setup failed (a peer died or timed out between creating its segment and unlinking it):
 * remove the peers' segments we know the names of, not only ours, since their creators
 * may never get to it. Those still alive have mapped theirs already, or fail too. */
static void remove_peer_segments(rs_comm_t *comm) {
    for (int p = 0; p < comm->size; p++) {
        if (!is_peer(comm, p) || comm->shm->pids[p] <= 0)
            continue;
        char name[NAME_LEN];
        segment_name(name, sizeof name, comm->job_id, p, comm->shm->pids[p]);
        shm_unlink(name);
    }
}

/* Creates, then maps, with a barrier after each step that tells every rank whether all
 * succeeded (*failed < 0). An error return is a failed barrier (TCP, a peer gone). */
static rs_status_t attach(rs_comm_t *comm, int *failed, int *error) {
    struct rs_shm *shm = comm->shm;
    RS_CHECK(local_barrier(comm, create_segment(shm), failed, error)); /* all exist */
    if (*failed >= 0)
        return RS_OK;
    int mapped = 0;
    for (int p = 0; p < comm->size && !mapped; p++)
        if (is_peer(comm, p))
            mapped = map_peer(comm, p);
    RS_CHECK(local_barrier(comm, mapped, failed, error)); /* all mapped by all who need them */
    unlink_mine(shm);
    return RS_OK;
}

/* Rings in a segment are indexed by the sender's place among the receiver's host's other
 * ranks: a segment holds local_size - 1 rings, whatever the world size. */
static int slot(const struct rs_shm *shm, int sender, int receiver) {
    return shm->index[sender] - (shm->index[sender] > shm->index[receiver]);
}

static void wire_rings(rs_comm_t *comm) {
    struct rs_shm *shm = comm->shm;
    for (int p = 0; p < comm->size; p++)
        if (is_peer(comm, p)) {
            shm->rx[p] = &shm->mine[slot(shm, p, comm->rank)];
            shm->tx[p] = &shm->theirs[p][slot(shm, comm->rank, p)];
        }
}

static int same_host(const rs_comm_t *comm, int peer) {
    return peer != comm->rank &&
           strcmp(rs_peer_host(comm, peer), rs_peer_host(comm, comm->rank)) == 0;
}

static rs_status_t shm_alloc(rs_comm_t *comm) {
    struct rs_shm *shm = calloc(1, sizeof *shm);
    if (!shm)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    comm->shm = shm;
    shm->fd = -1;
    shm->theirs = calloc((size_t)comm->size, sizeof *shm->theirs);
    shm->rx = calloc((size_t)comm->size, sizeof *shm->rx);
    shm->tx = calloc((size_t)comm->size, sizeof *shm->tx);
    shm->index = calloc((size_t)comm->size, sizeof *shm->index);
    shm->pids = calloc((size_t)comm->size, sizeof *shm->pids);
    if (!shm->theirs || !shm->rx || !shm->tx || !shm->index || !shm->pids) {
        shm_release(comm);
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    }
    /* Every rank of a host sees the same list of the host's ranks, in rank order. */
    for (int p = 0; p < comm->size; p++)
        shm->index[p] = p == comm->rank || same_host(comm, p) ? shm->local_size++ : -1;
    /* The same-host fast lane's areas (lane.c) follow the rings. */
    shm->segment_bytes = (size_t)(shm->local_size - 1) * sizeof(ring_t) +
                         RS_LANE_AREAS * RS_LANE_AREA_BYTES;
    segment_name(shm->name, sizeof shm->name, comm->job_id, comm->rank, (int)getpid());
    return RS_OK;
}

/* Shared memory could not be had on this host: a clear error where it was required,
 * else one warning and TCP with the same-host peers. */
static rs_status_t refuse(rs_comm_t *comm, int required, int failed, int error) {
    struct rs_shm *shm = comm->shm;
    char reason[768];
    if (failed == comm->rank) {
        snprintf(reason, sizeof reason, "%s", shm->why);
    } else {
        char space[128];
        describe_space(space, sizeof space);
        snprintf(reason, sizeof reason, "rank %d could not set up its segment (%.1f MiB%s): %s",
                 failed, mib((double)shm->segment_bytes), space, strerror(error));
    }
    if (required)
        return rs_fail(comm, RS_ERR_SYSTEM, "rank %d: RINGSYNC_TRANSPORT=shm, but shared memory "
                       "with the ranks on this host is unavailable: %s; RINGSYNC_TRANSPORT=tcp "
                       "avoids it (or a larger /dev/shm)", comm->rank, reason);
    fprintf(stderr, "ringsync: rank %d: shared memory unavailable (%s); using TCP with "
            "same-host peers\n", comm->rank, reason);
    return RS_OK;
}

static rs_status_t check_hosts(rs_comm_t *comm, int required, int *any) {
    *any = 0;
    for (int p = 0; p < comm->size; p++) {
        if (required && p != comm->rank && !same_host(comm, p))
            return rs_fail(comm, RS_ERR_USAGE, "RINGSYNC_TRANSPORT=shm, but rank %d is on host "
                           "%s, not on %s with rank %d", p, rs_peer_host(comm, p),
                           rs_peer_host(comm, comm->rank), comm->rank);
        *any |= same_host(comm, p);
    }
    return RS_OK;
}

rs_status_t rs_shm_setup(rs_comm_t *comm, int required) {
    int any, failed = -1, error = 0;
    RS_CHECK(check_hosts(comm, required, &any));
    if (!any)
        return RS_OK;
    RS_CHECK(shm_alloc(comm));
    if (comm->shm->index[comm->rank] == 0) /* one scan per host and job is enough */
        remove_orphans();
    /* The setup barriers run over TCP: the hybrid table is installed only after. */
    rs_status_t st;
    RS_CHECK_GOTO(attach(comm, &failed, &error), st, detach);
    if (failed >= 0) {
        st = refuse(comm, required, failed, error); /* RS_OK: TCP it is (a warning) */
        goto release;
    }
    wire_rings(comm);
    comm->shm->below = comm->transport;
    comm->transport = &rs_shm_transport;
    return RS_OK;
detach:
    remove_peer_segments(comm);
release:
    shm_release(comm); /* comm->shm stays NULL on TCP: the lane looks at it */
    return st;
}

/* ---- the fast lane's areas ---- */

static int all_local(const rs_comm_t *comm) {
    for (int p = 0; p < comm->size; p++)
        if (p != comm->rank && !is_local(comm, p))
            return 0;
    return comm->shm != NULL;
}

static void *shm_shared_area(rs_comm_t *comm, int rank, int area) {
    struct rs_shm *shm = comm->shm;
    if (!all_local(comm) || area < 0 || area >= RS_LANE_AREAS || rank < 0 || rank >= comm->size)
        return NULL;
    ring_t *segment = rank == comm->rank ? shm->mine : shm->theirs[rank];
    return (char *)segment + (size_t)(shm->local_size - 1) * sizeof(ring_t) +
           (size_t)area * RS_LANE_AREA_BYTES;
}

/* ---- the rings ---- */

static ring_t *ring_to(rs_comm_t *comm, int peer) { return comm->shm->tx[peer]; }
static ring_t *ring_from(rs_comm_t *comm, int peer) { return comm->shm->rx[peer]; }

static void ring_doorbell(rs_comm_t *comm, int peer, int *sleeping) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleeping, __ATOMIC_RELAXED)) {
        __atomic_store_n(sleeping, 0, __ATOMIC_RELAXED);
        char bell = DOORBELL;
        size_t done = 0;
        /* Unchecked on purpose: a full socket already holds a bell, and a broken one is
         * reported by the next poll or transfer on that peer. */
        comm->shm->below->send(comm, peer, &bell, 1, &done);
        /* A wake-up, not data: the traffic counters say where the collectives' bytes
         * went, so the bell comes back out of the TCP count the send below added. */
        rs_count_sent(comm, RS_VIA_TCP, peer, -(int64_t)done);
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

/* A ring's counters are in shared memory, where the peer can write anything: counters
 * that put more than the ring's bytes between them would have a copy run past the ring. */
static rs_status_t forged_ring(rs_comm_t *comm, int peer, const char *way, uint64_t head,
                               uint64_t tail) {
    return rs_fail(comm, RS_ERR_COMM, "rank %d: the shared-memory ring %s rank %d holds "
                   "%llu bytes by its counters (head %llu, tail %llu), more than its %llu: "
                   "rank %d wrote them, or corrupted its memory; the communicator is broken",
                   comm->rank, way, peer, (unsigned long long)(head - tail),
                   (unsigned long long)head, (unsigned long long)tail,
                   (unsigned long long)RING_BYTES, peer);
}

/* A same-host peer's ring is used once the socket that carries its doorbells exists
 * (connections are made on first use): until then nothing moves, and its waits are
 * waits for that connection. */
static rs_status_t linked(rs_comm_t *comm, int peer, int *yes) {
    return comm->shm->below->reach(comm, peer, yes);
}

static rs_status_t shm_send(rs_comm_t *comm, int peer, const char *buf, size_t len,
                            size_t *done) {
    if (!is_local(comm, peer))
        return comm->shm->below->send(comm, peer, buf, len, done);
    int yes;
    RS_CHECK(linked(comm, peer, &yes));
    if (!yes)
        return RS_OK;
    ring_t *r = ring_to(comm, peer);
    uint64_t head = r->header.head; /* only we write it (in the peer's segment, though) */
    uint64_t tail = __atomic_load_n(&r->header.tail, __ATOMIC_ACQUIRE);
    if (head - tail > RING_BYTES)
        return forged_ring(comm, peer, "to", head, tail);
    size_t room = (size_t)(RING_BYTES - (head - tail));
    size_t n = len - *done < room ? len - *done : room;
    if (n == 0)
        return RS_OK;
    copy_ring(r->data, buf + *done, head, n, 1);
    __atomic_store_n(&r->header.head, head + n, __ATOMIC_RELEASE);
    *done += n;
    rs_count_sent(comm, RS_VIA_SHM, peer, (int64_t)n);
    ring_doorbell(comm, peer, &r->header.consumer_sleeping);
    return RS_OK;
}

static rs_status_t shm_recv(rs_comm_t *comm, int peer, char *buf, size_t len, size_t *done) {
    if (!is_local(comm, peer))
        return comm->shm->below->recv(comm, peer, buf, len, done);
    int yes;
    RS_CHECK(linked(comm, peer, &yes));
    if (!yes)
        return RS_OK;
    ring_t *r = ring_from(comm, peer);
    uint64_t tail = r->header.tail;
    uint64_t head = __atomic_load_n(&r->header.head, __ATOMIC_ACQUIRE);
    if (head - tail > RING_BYTES)
        return forged_ring(comm, peer, "from", head, tail);
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
            int yes = 0;
            /* (not connected yet: the socket wait below waits for it; a failure to start
             * connecting is ready, for the transfer to meet it again and report it) */
            if (linked(comm, waits[k].peer, &yes) == RS_OK && !yes) {
                waits[k].ready = 0;
                continue;
            }
            waits[k].ready = yes ? shm_ready(comm, &waits[k], sleep) : 1;
            any |= waits[k].ready;
        }
    return any;
}

static rs_status_t drain_doorbells(rs_comm_t *comm, int peer) {
    char bells[64];
    size_t done;
    do {
        done = 0;
        RS_CHECK(comm->shm->below->recv(comm, peer, bells, sizeof bells, &done));
    } while (done == sizeof bells);
    return RS_OK;
}

/* A wait spins for spin_seconds, longer while a calling thread is blocked waiting for the
 * engine (whose core is then idle). */
static double spin_time(const rs_comm_t *comm) {
    int waiting = __atomic_load_n(&comm->callers_waiting, __ATOMIC_RELAXED);
    double spin = comm->spin_seconds;
    return waiting && comm->waiting_spin_seconds > spin ? comm->waiting_spin_seconds : spin;
}

static rs_status_t shm_poll(rs_comm_t *comm, rs_wait_t *waits, int n, int timeout_ms,
                            int *lost_peer) {
    *lost_peer = -1;
    for (int k = 0; k < n; k++)
        waits[k].ready = 0;
    double spin_until = rs_now() + spin_time(comm);
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
    rs_status_t st;
    RS_CHECK_GOTO(comm->shm->below->poll(comm, socket_waits, n, timeout_ms, lost_peer), st, out);
    for (int k = 0; k < n; k++) {
        if (!is_local(comm, waits[k].peer)) {
            waits[k].ready = socket_waits[k].ready;
            continue;
        }
        if (socket_waits[k].ready)
            RS_CHECK_GOTO(drain_doorbells(comm, waits[k].peer), st, out);
    }
    mark_shm_ready(comm, waits, n, 0);
out:
    if (socket_waits != stack_waits)
        free(socket_waits);
    return st;
}

static void shm_abort(rs_comm_t *comm) { comm->shm->below->abort(comm); }

static int shm_peer_aborted(rs_comm_t *comm, int peer) {
    return comm->shm->below->peer_aborted(comm, peer);
}

/* A same-host peer with no connection yet is still seen to die: by its pid. */
static int shm_peer_state(rs_comm_t *comm, int peer) {
    int state = comm->shm->below->peer_state(comm, peer);
    int pid = is_local(comm, peer) ? comm->shm->pids[peer] : 0;
    if (state == RS_PEER_UP && pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH)
        return RS_PEER_LOST;
    return state;
}

static int shm_reported_lost(rs_comm_t *comm, int peer) {
    return comm->shm->below->reported_lost(comm, peer);
}

static rs_status_t shm_reach(rs_comm_t *comm, int peer, int *yes) {
    return linked(comm, peer, yes);
}

static void shm_close(rs_comm_t *comm) {
    const rs_transport_t *below = comm->shm->below;
    shm_release(comm);
    below->close(comm);
}

const rs_transport_t rs_shm_transport = {
    .name = "shm",
    .listen = NULL, /* installed by rs_shm_setup, once TCP has connected */
    .connect = NULL,
    .reach = shm_reach,
    .send = shm_send,
    .recv = shm_recv,
    .poll = shm_poll,
    .abort = shm_abort,
    .close = shm_close,
    .peer_aborted = shm_peer_aborted,
    .reported_lost = shm_reported_lost,
    .peer_state = shm_peer_state,
    .shared_area = shm_shared_area,
};
