"""What a rank costs as the job grows: N ranks as threads of this one process (the native
core has no globals; each rank has its own communicator, sockets and engine thread), or,
with --processes, N real processes under mpirun across namespace hosts.

    python benchmarks/scale_cost.py                 # N = 2 4 8 16 32, over TCP
    python benchmarks/scale_cost.py --sizes 4 8 --iterations 100

Per N it prints:
  setup ms        the slowest rank's Communicator() (listen, rendezvous, connect, engine)
  gather ring/log one 48-byte-per-rank rs_allgatherv on raw communicators (a negotiation
                  round's first exchange with an empty cache), ring (N-1 steps) against
                  the log-round gather (ceil(log2 N) steps); median, microseconds
  round ring/log  one tiny engine allreduce (4 bytes, negotiated from the cache, then one
                  exchange with every peer), RINGSYNC_SMALL_GATHER_BYTES=0 (the ring) against
                  the default (log rounds); median, microseconds
  fds/rank        descriptors each rank adds (/proc/self/fd, after init, / N)
  RSS/rank        resident memory each rank adds (VmRSS after init, / N); thread ranks share
                  the interpreter, so a process per rank adds its ~30 MiB of Python on top
  shm MiB/rank    the shared segment a rank maps where all N ranks share one host
                  (transport_shm.c: a 2 MiB ring per same-host peer + the lane's areas);
                  the host holds N times that
  pending B       engine memory per tensor that some ranks have submitted and others not
                  (engine.h: rs_pending_t + one rs_meta_t and one flag per rank + its name)

On a host with fewer cores than ranks the times measure scheduling as much as the
algorithms: compare the two columns of a row, not rows across machines.

Processes (--processes; needs root and mpirun: ringsync.testing.VirtualHosts, no rate limit):

    python benchmarks/scale_cost.py --processes                  # N = 64 128 256 on 8 hosts
    python benchmarks/scale_cost.py --processes --sizes 16 32 --hosts 2 --markdown
    python benchmarks/scale_cost.py --processes --sizes 64 256 --hosts 8 32   # hosts per N
    python benchmarks/scale_cost.py --processes --save costs.json --model-table
    python benchmarks/scale_cost.py --load costs.json --markdown --model-table   # no job

One mpirun job per N (ringsync.testing.run_mpi), N/H ranks on each of H hosts made afresh
for it, oversubscribed: every rank is a process on this machine's cores. Each rank runs
process_rank (below) after MPI_Init and `import ringsync`: MPI's own connections made
(warm_mpi), an MPI barrier, rs.init(), --iterations tiny allreduces and barriers after 5
warm-ups each, a 16 MiB float32 allreduce_ once to warm up and 5 times timed; it writes
its figures as one JSON record. Per N the table has (each "model" column is model(N, H)
fitted to the rows measured; see MODEL_FORMS):
  N, hosts        ranks, and hosts they ran on (distinct host names the ranks saw)
  MPI sock        socket descriptors a rank holds before init (/proc/self/fd entries
                  "socket:[...]", after warm_mpi: MPI's own); the most of any rank
  rs init/round/  the sockets ringsync added (held - MPI sock; the most of any rank)
  barrier/end     after init, after the tiny allreduces, the barriers, and the 16 MiB
                  allreduces: what the process holds is MPI sock + these
  this host/other of "rs end", TCP connections to ranks on this host / on other hosts
  fds 0/end       all descriptors, before init and at the end
  setup ms        rs.init() on the slowest rank (the ranks enter it together)
  setup CPU ms    the CPU time rs.init() took in the rank's process (all its threads),
                  median over ranks: the rank's own work, which N processes sharing a
                  few cores cannot inflate the way they inflate wall time
  round us        one 4-byte allreduce (a negotiation round from the cache, then the
                  exchange): the median over ranks of each rank's median
  round CPU us     the CPU time of one such round in the rank's process (all threads),
                  averaged over the warm-ups and the timed rounds, median over ranks
  barrier us      one rs.barrier(), the same way
  16 MiB ms       one 16 MiB allreduce: the median over ranks of each rank's median of 5
  RSS MiB         VmRSS at the end (the 16 MiB buffer freed), median over ranks;
  ringsync        what it gained since before init (init, engine, transports, buffers
                  kept), median; "peak": the largest VmHWM of any rank
  shm MiB         the segment each rank reserves in /dev/shm at init (a 2 MiB ring per
                  other rank on its host and the lane's areas; 0 with --transport tcp)
  job GiB         how far MemAvailable fell during the job (every rank, the segments,
                  mpirun's daemons, and anything else running: sampled, at most)
Then the model's constants (least squares over the rows, each constant >= 0; with
--choose-forms the best fitting of each figure's forms) and how far it misses the rows,
and with --model-table its predictions for N = 16 .. 4096 on hosts of 8 ranks, as
markdown. The times are those of N processes sharing this machine's cores: they grow
with scheduling as much as with the algorithms.

Before each job its memory is estimated (per rank as the last job measured, or
PRIVATE_MIB_PER_RANK, plus the segments) and the job is refused above MEMORY_HEADROOM of
MemAvailable (--force runs it). The segments grow as the square of ranks per host: 256
ranks on 8 hosts reserve 256 x 63 MiB; more hosts, or --transport tcp, need less. Each
job has a deadline (--timeout; 120 s + 4 s a rank): past it every rank prints its stacks,
and a failed job prints every rank's outcome and the job's output.
"""
import argparse
import itertools
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ringsync as rs  # noqa: E402
from ringsync._native import ffi, lib  # noqa: E402
from ringsync.config import Config  # noqa: E402
from ringsync.rendezvous import ThreadGroup  # noqa: E402

HOST = b"127.0.0.1"
SECRET = bytes(range(32))

# Struct sizes from native/src (x86-64): rs_meta_t (checked.h): 6 int32 + 2 double + 8
# int64 = 104; rs_pending_t (negotiate.h): 3 pointers, int + pad, int64, double, 2 ints,
# pointer = 72. The ring header (transport_shm.c) is 4 cache lines.
META_BYTES, PENDING_BYTES = 104, 72
RING_BYTES = (1 << 21) + 256
LANE_AREA_BYTES = 2 * ((256 << 10) + 4000 + 1024) + 128  # RS_LANE_AREA_BYTES (transport.h)
LANE_AREAS = 2


def on_threads(fn, size):
    out, errors = [None] * size, []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as e:
            errors.append(f"rank {r}: {e!r}")
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError("; ".join(errors) or "a rank did not finish")
    return out


def fds():
    return len(os.listdir("/proc/self/fd"))


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def raw_gather_us(size, iterations, threshold, record=48):
    """Median microseconds of one allgather of `record` bytes per rank, raw comms."""
    comms, ports = [], []
    for r in range(size):
        cptr, port = ffi.new("rs_comm_t **"), ffi.new("int *")
        assert lib.rs_comm_create(r, size, HOST, 60.0, 60.0, cptr, port) == lib.RS_OK
        assert lib.rs_comm_set_transport(cptr[0], lib.RS_TRANSPORT_TCP) == lib.RS_OK
        comms.append(cptr[0])
        ports.append(port[0])
    hosts = [ffi.new("char[]", HOST) for _ in range(size)]
    on_threads(lambda r: lib.rs_comm_connect(comms[r], ffi.new("const char *[]", hosts),
                                             ffi.new("int[]", ports),
                                             ffi.new("const char *[]", hosts), 7, SECRET,
                                             len(SECRET)), size)
    counts = ffi.new("int64_t[]", [record] * size)

    def rank(r):
        lib.rs_comm_set_small_gather(comms[r], threshold)
        mine, out, times = np.full(record, r, np.uint8), np.empty(record * size, np.uint8), []
        for _ in range(iterations):
            t0 = time.perf_counter()
            st = lib.rs_allgatherv(comms[r], ffi.from_buffer(mine), ffi.from_buffer(out),
                                   counts, 1)
            times.append(time.perf_counter() - t0)
            assert st == lib.RS_OK, ffi.string(lib.rs_comm_last_error(comms[r]))
        return statistics.median(times) * 1e6
    try:
        return max(on_threads(rank, size))
    finally:
        for c in comms:
            lib.rs_comm_destroy(c)


def engine_job(size, iterations, small_gather):
    """(setup ms, median us per tiny allreduce, fds per rank, RSS bytes per rank)."""
    group = ThreadGroup(size, timeout=600)
    env = {"RINGSYNC_TRANSPORT": "tcp", "RINGSYNC_SMALL_GATHER_BYTES": str(small_gather)}
    fds_before, rss_before = fds(), rss_bytes()
    barrier = threading.Barrier(size)
    sample = {}

    def rank(r):
        t0 = time.perf_counter()
        comm = rs.Communicator(rendezvous=group.rendezvous(r), config=Config.from_env(env))
        setup = time.perf_counter() - t0
        barrier.wait()
        if r == 0:
            sample["fds"], sample["rss"] = fds(), rss_bytes()
        barrier.wait()
        x, times = np.ones(1, np.float32), []
        for i in range(iterations + 5):
            t0 = time.perf_counter()
            comm.allreduce(x, op=rs.Sum, name="tiny")
            times.append(time.perf_counter() - t0)
        comm.shutdown()
        return setup, statistics.median(times[5:])
    results = on_threads(rank, size)
    return (max(s for s, _ in results) * 1e3, max(t for _, t in results) * 1e6,
            (sample["fds"] - fds_before) / size, (sample["rss"] - rss_before) / size)


def shm_mib(size):
    return ((size - 1) * RING_BYTES + LANE_AREAS * LANE_AREA_BYTES) / 2**20


def pending_bytes(size, name_len=24):
    return PENDING_BYTES + size * (META_BYTES + 1) + name_len + 1


# ------------------------------------------------------------------------ --processes

RANK_TARGET = "benchmarks.scale_cost:process_rank"  # each rank imports it (repo on path)
MIB = 1 << 20
BIG_BYTES = 16 << 20
BIG_RUNS = 5
WARMUP = 5
PRIVATE_MIB_PER_RANK = 150  # memory estimate per rank before one job has measured it
MEMORY_HEADROOM = 0.85  # of MemAvailable, the most a job is expected to take


def fd_targets():
    targets = []
    for name in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return targets


def descriptors():
    """(socket descriptors, all descriptors) this process holds."""
    targets = fd_targets()
    return sum(t.startswith("socket:") for t in targets), len(targets)


def socket_kinds():
    """This process's sockets by kind: TCP listening, TCP to this host (both ends one
    address: the same namespace), TCP to other hosts, and the rest (Unix: MPI's)."""
    mine = {t[len("socket:["):-1] for t in fd_targets() if t.startswith("socket:[")}
    kinds = dict(listen=0, same_host=0, other_hosts=0)
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):  # no IPv6
            continue
        with open(table) as f:
            for line in f.readlines()[1:]:
                field = line.split()
                if field[9] not in mine:
                    continue
                mine.discard(field[9])
                local, remote = field[1].split(":")[0], field[2].split(":")[0]
                kind = ("listen" if field[3] == "0A" else  # TCP_LISTEN
                        "same_host" if local == remote else "other_hosts")
                kinds[kind] += 1
    kinds["other"] = len(mine)
    return kinds


def memory_mib():
    """{VmRSS, VmHWM, RssAnon, RssShmem} of this process, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    return out


def median_s(call, warmup, runs):
    for _ in range(warmup):
        call()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def warm_mpi(comm, payload=512):
    """Make MPI's own connections before descriptors are counted: the nonblocking
    collectives ringsync's MPI rendezvous makes (bootstrap.bounded_allgather, _bcast)."""
    from mpi4py import MPI
    n = comm.Get_size()
    sizes = np.zeros(n, np.int64)
    comm.Iallgather([np.array([payload], np.int64), MPI.INT64_T],
                    [sizes, MPI.INT64_T]).Wait()
    gathered = np.zeros(payload * n, np.uint8)
    comm.Iallgatherv([np.zeros(payload, np.uint8), MPI.BYTE],
                     [gathered, ([payload] * n, [payload * i for i in range(n)]),
                      MPI.BYTE]).Wait()
    comm.Ibcast([np.zeros(payload, np.uint8), MPI.BYTE], root=0).Wait()
    comm.Ibarrier().Wait()


def process_rank(outdir, iterations):
    """One rank of a --processes job, run by ringsync.testing's worker (MPI_Init done,
    ringsync imported): measures, then writes rank<r>.json into outdir."""
    from mpi4py import MPI
    warm_mpi(MPI.COMM_WORLD)
    record = measure_rank(int(iterations), MPI.COMM_WORLD.Barrier)
    write_record(outdir, record)
    rs.shutdown()
    # MPI_Finalize of 128 processes over 16 namespace hosts did not return within the
    # job's deadline (not investigated): once every record is written (the barrier: the
    # first rank to leave without finalizing has mpirun kill the rest) the rank ends here.
    MPI.COMM_WORLD.Barrier()
    sys.stdout.flush()
    os._exit(0)


def write_record(outdir, record):
    from ringsync.testing import write_atomically
    write_atomically(os.path.join(outdir, f"rank{record['rank']}.json"),
                     json.dumps(record) + "\n")


def measure_rank(iterations, together):
    """This rank's record: descriptors, memory, setup (rs.init, entered by every rank at
    once through together() where the launcher offers a barrier), a tiny allreduce, a
    barrier and a 16 MiB allreduce. ringsync is left initialised."""
    before, kinds_before, memory_before = descriptors(), socket_kinds(), memory_mib()
    together()  # into init together: setup is init's own time
    t0, cpu0 = time.perf_counter(), time.process_time()
    rs.init()
    setup_ms = (time.perf_counter() - t0) * 1e3
    setup_cpu_ms = (time.process_time() - cpu0) * 1e3  # this rank's own work, all threads
    at_init, memory_init = descriptors(), memory_mib()
    tiny = np.ones(1, np.float32)
    cpu0 = time.process_time()
    round_us = median_s(lambda: rs.allreduce(tiny, op=rs.Sum, name="tiny"), WARMUP,
                        iterations) * 1e6
    round_cpu_us = (time.process_time() - cpu0) / (WARMUP + iterations) * 1e6
    after_round = descriptors()
    barrier_us = median_s(rs.barrier, WARMUP, iterations) * 1e6
    after_barrier = descriptors()
    big = np.ones(BIG_BYTES // 4, np.float32)
    big_ms = median_s(lambda: rs.allreduce_(big, name="big"), 1, BIG_RUNS) * 1e3
    big = None  # freed before the memory is read
    after, kinds, memory_after = descriptors(), socket_kinds(), memory_mib()
    return dict(
        rank=rs.rank(), host=socket.gethostname(), local_size=rs.local_size(),
        sockets_before=before[0], sockets_init=at_init[0], sockets_round=after_round[0],
        sockets_barrier=after_barrier[0], sockets_after=after[0],
        fds_before=before[1], fds_init=at_init[1], fds_after=after[1],
        **{"sockets_" + kind: count for kind, count in kinds.items()},
        **{"sockets_before_" + kind: count for kind, count in kinds_before.items()},
        setup_ms=setup_ms, round_us=round_us, barrier_us=barrier_us, big_ms=big_ms,
        setup_cpu_ms=setup_cpu_ms, round_cpu_us=round_cpu_us,
        rss_import_mib=memory_before["VmRSS"], rss_init_mib=memory_init["VmRSS"],
        rss_mib=memory_after["VmRSS"], hwm_mib=memory_after["VmHWM"],
        anon_mib=memory_after["RssAnon"], shmem_mib=memory_after["RssShmem"])


def mem_available_gib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


class MemoryWatch:
    """How far MemAvailable falls below its level at the start, at most (sampled)."""

    def __init__(self, every_s=0.2):
        self.start = self.lowest = mem_available_gib()
        self._every, self._done = every_s, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._done.wait(self._every):
            self.lowest = min(self.lowest, mem_available_gib())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    @property
    def used_gib(self):
        return self.start - self.lowest


def slots_per_host(n, hosts):
    return [n // hosts + (i < n % hosts) for i in range(hosts)]


def segment_mib(n, hosts, transport):
    """/dev/shm each rank reserves: a segment for the ranks of the fullest host."""
    return 0.0 if transport == "tcp" else shm_mib(max(slots_per_host(n, hosts)))


def expected_gib(n, hosts, transport, rows):
    """A job's memory: per-rank memory (as the last job measured it, less its segments)
    plus the segments this job reserves."""
    per_rank = PRIVATE_MIB_PER_RANK
    if rows:
        last = rows[-1]
        per_rank = last["job_gib"] * 1024 / last["N"] - last["shm_mib"]
    return n * (per_rank + segment_mib(n, hosts, transport)) / 1024


def mpirun_environment():
    """What mpirun needs here (tests/conftest.py sets the same; run_mpi adds PATH)."""
    os.environ.setdefault("OMPI_MCA_btl", "^ofi")  # no libfabric probe in every MPI_Init
    # Ranks waiting in MPI (init, finalize) would spin on cores the measured ranks need.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


def run_job(n, hosts, args):
    """One mpirun job of n ranks on hosts (a VirtualHosts): (records, job GiB, seconds),
    or None after printing every rank's outcome when it failed."""
    from ringsync.testing import run_mpi
    timeout = args.timeout or 120 + 4 * n
    env = {"OMP_NUM_THREADS": "1", "RINGSYNC_TRANSPORT": args.transport,
           "RINGSYNC_TIMEOUT_SECONDS": str(timeout // 2),
           "RINGSYNC_START_TIMEOUT_SECONDS": str(timeout // 2)}
    outdir = tempfile.mkdtemp(prefix="ringsync-scale-")
    try:
        t0 = time.monotonic()
        with MemoryWatch() as watch:
            result = run_mpi(RANK_TARGET, np=n, hosts=hosts,
                             slots=slots_per_host(n, len(hosts.names)), timeout=timeout,
                             env=env, args=(outdir, args.iterations))
        seconds = time.monotonic() - t0
        records = []
        for name in sorted(os.listdir(outdir)):
            with open(os.path.join(outdir, name)) as f:
                records.append(json.loads(f.read()))
        if len(records) < n:
            print(result.report(), file=sys.stderr, flush=True)
            return None
        return records, watch.used_gib, seconds
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def summarize(n, records, job_gib, seconds, transport):
    """One table row from a job's per-rank records."""
    def top(key):
        return max(r[key] for r in records)

    def mid(key):
        return statistics.median(r[key] for r in records)

    def added(key, before="sockets_before"):  # ringsync's: the most any rank gained
        return max(r[key] - r[before] for r in records)
    hosts = len({r["host"] for r in records})
    return dict(
        N=n, hosts=hosts, ranks=len(records), seconds=seconds,
        sockets_before=top("sockets_before"), sockets_held=top("sockets_after"),
        sockets_init=added("sockets_init"), sockets_round=added("sockets_round"),
        sockets_barrier=added("sockets_barrier"), sockets=added("sockets_after"),
        sockets_same_host=added("sockets_same_host", "sockets_before_same_host"),
        sockets_other_hosts=added("sockets_other_hosts", "sockets_before_other_hosts"),
        fds_before=top("fds_before"),
        fds_after=top("fds_after"), setup_ms=top("setup_ms"), round_us=mid("round_us"),
        setup_cpu_ms=mid("setup_cpu_ms"), round_cpu_us=mid("round_cpu_us"),
        barrier_us=mid("barrier_us"), big_ms=mid("big_ms"), rss_mib=mid("rss_mib"),
        ringsync_mib=statistics.median(r["rss_mib"] - r["rss_import_mib"] for r in records),
        peak_mib=top("hwm_mib"), shm_mib=segment_mib(n, hosts, transport), job_gib=job_gib)


def hosts_for(args):
    """The host count of each size: one --hosts for all, or one per size."""
    if len(args.hosts) not in (1, len(args.sizes)):
        sys.exit("scale_cost: give one --hosts, or one per size")
    return list(zip(args.sizes, args.hosts * len(args.sizes) if len(args.hosts) == 1
                    else args.hosts))


def run_size(n, host_count, args, rows):
    """One job of n ranks on fresh hosts: its row and records, or None (refused, failed)."""
    from ringsync.testing import VirtualHosts
    need, have = expected_gib(n, host_count, args.transport, rows), mem_available_gib()
    print(f"N={n} on {host_count} hosts: expect {need:.1f} GiB of {have:.1f} GiB available",
          flush=True)
    if need > MEMORY_HEADROOM * have and not args.force:
        print(f"  refused: over {MEMORY_HEADROOM:.0%} of what is available (more --hosts "
              f"make smaller segments, --transport tcp none; --force runs it)", flush=True)
        return None
    with VirtualHosts(host_count, rate=None) as hosts:
        if args.launcher == "ringsync":
            from benchmarks import scale_launched
            job = scale_launched.run_job(n, hosts, args)
        else:
            job = run_job(n, hosts, args)
    if job is None:
        print(f"  N={n} failed (its report is above)", flush=True)
        return None
    row = summarize(n, *job, args.transport)
    print(f"  {row['seconds']:.0f} s, {row['job_gib']:.1f} GiB at most, RSS "
          f"{row['rss_mib']:.0f} MiB/rank (peak {row['peak_mib']:.0f}), shm "
          f"{row['shm_mib']:.0f} MiB/rank", flush=True)
    return row, job[0]


def run_processes(args):
    """One job per N; returns the rows and {N: records} (stops at a failed or refused
    job)."""
    from ringsync.testing import virtual_hosts_unavailable
    reason = virtual_hosts_unavailable()
    if reason:
        sys.exit(f"scale_cost --processes: {reason}")
    mpirun_environment()
    rows, records = [], {}
    for n, host_count in hosts_for(args):
        done = run_size(n, host_count, args, rows)
        if done is None:
            break
        rows.append(done[0])
        records[n] = done[1]
    return rows, records


# model(n, hosts): each figure a sum of named constants, each times a feature of N ranks
# on H hosts, fitted by nonnegative least squares (every constant is a cost). MODEL_FORMS
# lists per figure its forms, each a tuple of constants. The first is the model; with
# --choose-forms every form whose constants the rows outnumber is fitted, and the one
# with the least squared error per row left over wins (on a few cores, times grow with
# scheduling N processes, faster than the algorithms do: compare the constants).
def one(n, h):
    return 1.0


def peers(n, h):  # a full mesh
    return n - 1.0


def remote_peers(n, h):  # peers on other hosts
    return n - n / h


def log2_steps(n, h):  # log-round partners
    return float(math.ceil(math.log2(n)))


def log2(n, h):
    return math.log2(n)


def ranks(n, h):
    return float(n)


def ranks_squared(n, h):  # N ranks sharing a few cores, each doing work that grows with N
    return float(n) ** 2


def ring_mib(n, h):  # what a rank sends in a ring allreduce of 16 MiB: 2(N-1)/N of it
    return 2.0 * (n - 1) / n * BIG_BYTES / MIB


FEATURES = {
    "INIT_SOCKETS_BASE": one, "INIT_SOCKETS_PER_LOG2": log2_steps,
    "INIT_SOCKETS_PER_PEER": peers,
    "SOCKETS_BASE": one, "SOCKETS_PER_PEER": peers, "SOCKETS_PER_LOG2": log2_steps,
    "SOCKETS_PER_REMOTE_PEER": remote_peers,
    "SETUP_MS_BASE": one, "SETUP_MS_PER_LOG2": log2, "SETUP_MS_PER_RANK": ranks,
    "ROUND_US_BASE": one, "ROUND_US_PER_LOG2": log2, "ROUND_US_PER_RANK": ranks,
    "ROUND_US_PER_RANK2": ranks_squared,
    "BIG_MS_PER_MIB": ring_mib,  # 1 / bandwidth, ms per MiB
    "BIG_MS_PER_RANK": ranks, "BIG_MS_PER_RANK2": ranks_squared,
    "RSS_MIB_BASE": one,  # Python, numpy, MPI, ringsync
    "RSS_MIB_PER_RANK": ranks,  # per-peer state: sockets, records
}
MODEL_FORMS = {  # a row's key: its forms
    "sockets_init": [("INIT_SOCKETS_BASE", "INIT_SOCKETS_PER_LOG2"),
                     ("INIT_SOCKETS_BASE", "INIT_SOCKETS_PER_PEER")],
    "sockets": [("SOCKETS_BASE", "SOCKETS_PER_LOG2"), ("SOCKETS_BASE", "SOCKETS_PER_PEER"),
                ("SOCKETS_BASE", "SOCKETS_PER_PEER", "SOCKETS_PER_REMOTE_PEER")],
    "setup_ms": [("SETUP_MS_BASE", "SETUP_MS_PER_LOG2"),
                 ("SETUP_MS_BASE", "SETUP_MS_PER_RANK")],
    "round_us": [("ROUND_US_BASE", "ROUND_US_PER_LOG2"),
                 ("ROUND_US_BASE", "ROUND_US_PER_RANK"),
                 ("ROUND_US_BASE", "ROUND_US_PER_RANK2")],
    "big_ms": [("BIG_MS_PER_MIB", "BIG_MS_PER_RANK"), ("BIG_MS_PER_MIB", "BIG_MS_PER_RANK2")],
    "rss_mib": [("RSS_MIB_BASE", "RSS_MIB_PER_RANK")],
}
# Until two rows are measured: the README's model (every peer connected at init, and a
# listener), guesses for the rest.
DEFAULT_CONSTANTS = dict.fromkeys(FEATURES, 0.0)
DEFAULT_CONSTANTS.update(
    INIT_SOCKETS_BASE=1.0, INIT_SOCKETS_PER_PEER=1.0, SOCKETS_BASE=1.0, SOCKETS_PER_PEER=1.0,
    SETUP_MS_PER_LOG2=20.0, ROUND_US_PER_LOG2=100.0, BIG_MS_PER_MIB=1.0, BIG_MS_PER_RANK=1.0,
    RSS_MIB_BASE=55.0, RSS_MIB_PER_RANK=0.03)
MODEL_SIZES = (16, 64, 256, 1024, 4096)
MODEL_RANKS_PER_HOST = 8  # hosts of 8 ranks (GPUs) in --model-table


def model(n, hosts, constants=DEFAULT_CONSTANTS):
    """Predicted figures per rank for n ranks on `hosts` hosts (keys as in a row)."""
    out = {figure: sum(constants[c] * FEATURES[c](n, hosts)
                       for c in {c for form in forms for c in form})
           for figure, forms in MODEL_FORMS.items()}
    out["shm_mib"] = segment_mib(n, hosts, "auto")
    return out


def fit_form(rows, figure, form):
    """(squared error, {constant: value}): nonnegative least squares, as the best of the
    plain fits over each subset of the constants (the others 0) that comes out >= 0."""
    x = np.array([[FEATURES[c](r["N"], r["hosts"]) for c in form] for r in rows])
    y = np.array([r[figure] for r in rows], dtype=float)
    best = (float(np.sum(y ** 2)), dict.fromkeys(form, 0.0))
    for k in range(1, len(form) + 1):
        for subset in itertools.combinations(range(len(form)), k):
            part = x[:, subset]
            if np.linalg.matrix_rank(part) < k:
                continue  # the rows cannot tell these constants apart
            coef = np.linalg.lstsq(part, y, rcond=None)[0]
            error = float(np.sum((part @ coef - y) ** 2))
            if (coef >= 0).all() and error < best[0] * (1 - 1e-9) - 1e-12:
                best = (error, dict(dict.fromkeys(form, 0.0),
                                    **{form[i]: float(c) for i, c in zip(subset, coef)}))
    return best


def fit(rows, choose_forms=False):
    """The constants fitted to the rows (DEFAULT_CONSTANTS below 2 sizes), and the form
    used per figure: the first of MODEL_FORMS, or with choose_forms the best fitting."""
    constants, chosen = dict(DEFAULT_CONSTANTS), {}
    if len({(r["N"], r["hosts"]) for r in rows}) < 2:
        return constants, chosen
    for figure, forms in MODEL_FORMS.items():
        best = None
        forms = forms if choose_forms else forms[:1]
        for i, form in enumerate(forms):
            left = len(rows) - len(form)
            if left <= 0 and i > 0:
                continue
            error, fitted = fit_form(rows, figure, form)
            score = error / max(left, 1)
            if best is None or score < best[0] * (1 - 1e-6) - 1e-9:
                best = (score, fitted, form)
        constants.update({c: 0.0 for form in MODEL_FORMS[figure] for c in form})
        constants.update(best[1])
        chosen[figure] = best[2]
    return constants, chosen


COLUMNS = [  # (header, row key or model key prefixed "~", format)
    ("N", "N", "d"), ("hosts", "hosts", "d"), ("MPI sock", "sockets_before", "d"),
    ("rs init", "sockets_init", "d"), ("model", "~sockets_init", ".0f"),
    ("rs round", "sockets_round", "d"), ("rs barrier", "sockets_barrier", "d"),
    ("rs end", "sockets", "d"), ("model", "~sockets", ".0f"),
    ("this host", "sockets_same_host", "d"), ("other hosts", "sockets_other_hosts", "d"),
    ("fds 0", "fds_before", "d"),
    ("fds end", "fds_after", "d"), ("setup ms", "setup_ms", ".0f"),
    ("model", "~setup_ms", ".0f"), ("setup CPU ms", "setup_cpu_ms", ".1f"),
    ("round us", "round_us", ".0f"), ("model", "~round_us", ".0f"),
    ("round CPU us", "round_cpu_us", ".0f"), ("barrier us", "barrier_us", ".0f"),
    ("16 MiB ms", "big_ms", ".0f"), ("model", "~big_ms", ".0f"),
    ("RSS MiB", "rss_mib", ".0f"), ("model", "~rss_mib", ".0f"),
    ("ringsync", "ringsync_mib", ".0f"), ("peak", "peak_mib", ".0f"),
    ("shm MiB", "shm_mib", ".1f"), ("job GiB", "job_gib", ".1f")]
MODEL_COLUMNS = [("N", "N", "d"), ("hosts", "hosts", "d"),
                 ("sockets / rank at init", "sockets_init", ".0f"),
                 ("sockets / rank at the end", "sockets", ".0f"),
                 ("setup ms", "setup_ms", ".0f"), ("round us", "round_us", ".0f"),
                 ("16 MiB ms", "big_ms", ".0f"), ("RSS MiB / rank", "rss_mib", ".0f"),
                 ("shm MiB / rank", "shm_mib", ".1f")]


def print_table(columns, rows, markdown):
    heads = [h for h, _, _ in columns]
    cells = [[format(row[key], spec) if key in row else "-" for _, key, spec in columns]
             for row in rows]
    if markdown:
        print("| " + " | ".join(heads) + " |")
        print("|" + "---|" * len(heads))
        for line in cells:
            print("| " + " | ".join(line) + " |")
        return
    widths = [max([len(h)] + [len(line[i]) for line in cells]) for i, h in enumerate(heads)]
    for line in [heads] + cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def rms_error(rows, figure):
    """Root mean square of (model - measured) / measured over the rows."""
    return math.sqrt(statistics.mean(((r["~" + figure] - r[figure]) / r[figure]) ** 2
                                     for r in rows if r[figure]) or 0.0)


def print_constants(constants, chosen, rows):
    print("model constants, " + ("fitted to the rows (nonnegative least squares):"
                                 if chosen else "defaults (fewer than 2 sizes measured):"))
    for figure, forms in MODEL_FORMS.items():
        names = chosen.get(figure) or [c for form in forms for c in dict.fromkeys(form)
                                       if constants[c]]
        print(f"  {figure}: " + ", ".join(f"{c} = {constants[c]:.4g}"
                                           for c in dict.fromkeys(names)) +
              f" (rms error {rms_error(rows, figure):.0%})")
    if constants["BIG_MS_PER_MIB"] > 0:
        print(f"  (BIG_MS_PER_MIB as a rate: {MIB / 1e6 / constants['BIG_MS_PER_MIB']:.2f} "
              f"GB/s a rank)")


def report_processes(rows, args):
    constants, chosen = fit(rows, args.choose_forms)
    for row in rows:
        row.update({"~" + k: v for k, v in model(row["N"], row["hosts"], constants).items()})
    print(f"{os.cpu_count()} cores; rank processes on namespace hosts "
          f"(transport {args.transport}); {args.iterations} rounds, 16 MiB x {BIG_RUNS}")
    print_table(COLUMNS, rows, False)
    if args.markdown:
        print()
        print_table(COLUMNS, rows, True)
    print_constants(constants, chosen, rows)
    if args.model_table:
        predicted = []
        for n in MODEL_SIZES:
            hosts = max(1, n // MODEL_RANKS_PER_HOST)
            predicted.append(dict(N=n, hosts=hosts, **model(n, hosts, constants)))
        print(f"\nmodel, {MODEL_RANKS_PER_HOST} ranks a host:\n")
        print_table(MODEL_COLUMNS, predicted, True)


def processes_main(args):
    if args.load:
        with open(args.load) as f:
            saved = json.load(f)
        rows, args.transport, args.iterations = (saved["rows"], saved["transport"],
                                                 saved["iterations"])
    else:
        rows, records = run_processes(args)
        if args.save:
            with open(args.save, "w") as f:
                json.dump(dict(rows=rows, transport=args.transport,
                               iterations=args.iterations, records=records), f)
    if rows:
        report_processes([{k: v for k, v in r.items() if not k.startswith("~")}
                          for r in rows], args)
    if args.sizes and len(rows) < len(args.sizes) and not args.load:
        sys.exit(1)


def threads_main(args):
    sizes, iterations = args.sizes or [2, 4, 8, 16, 32], args.iterations or 200
    print(f"{os.cpu_count()} cores; thread ranks over TCP; times: median of "
          f"{iterations}, slowest rank")
    head = ("N", "setup ms", "gather ring us", "gather log us", "round ring us",
            "round log us", "fds/rank", "RSS KiB/rank", "shm MiB/rank", "pending B")
    print("  ".join(f"{h:>14}" for h in head))
    for n in sizes:
        ring_gather = raw_gather_us(n, iterations, 0)
        log_gather = raw_gather_us(n, iterations, 1 << 20)
        _, ring_round, _, _ = engine_job(n, iterations, 0)
        setup, log_round, per_fds, per_rss = engine_job(n, iterations, 1 << 20)
        row = (n, f"{setup:.0f}", f"{ring_gather:.0f}", f"{log_gather:.0f}",
               f"{ring_round:.0f}", f"{log_round:.0f}", f"{per_fds:.1f}",
               f"{per_rss / 1024:.0f}", f"{shm_mib(n):.1f}", pending_bytes(n))
        print("  ".join(f"{v:>14}" for v in row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+",
                        help="ranks per job (threads: 2 4 8 16 32; processes: 64 128 256)")
    parser.add_argument("--iterations", type=int,
                        help="timed rounds (threads: 200; processes: 30)")
    parser.add_argument("--processes", action="store_true",
                        help="real rank processes under mpirun across namespace hosts")
    parser.add_argument("--hosts", type=int, nargs="+", default=[8],
                        help="processes: hosts (namespaces), one for all sizes or one each")
    parser.add_argument("--transport", choices=("auto", "tcp", "shm"), default="auto",
                        help="processes: RINGSYNC_TRANSPORT (tcp: no shared segments)")
    parser.add_argument("--launcher", choices=("mpirun", "ringsync"), default="mpirun",
                        help="processes: who starts the ranks (ringsync: no MPI)")
    parser.add_argument("--timeout", type=int,
                        help="processes: seconds per job (default 120 + 4 per rank)")
    parser.add_argument("--force", action="store_true",
                        help="processes: run a job even if its memory looks too much")
    parser.add_argument("--markdown", action="store_true",
                        help="processes: the measured table as markdown too")
    parser.add_argument("--model-table", action="store_true",
                        help="processes: the fitted model's predictions, N = 16 .. 4096")
    parser.add_argument("--choose-forms", action="store_true",
                        help="processes: fit every form of MODEL_FORMS, keep the best")
    parser.add_argument("--save", help="processes: write the rows measured to this JSON file")
    parser.add_argument("--load", help="processes: no job, the tables from a --save file")
    args = parser.parse_args()
    if args.processes or args.load:
        args.sizes, args.iterations = args.sizes or [64, 128, 256], args.iterations or 30
        processes_main(args)
    else:
        threads_main(args)


if __name__ == "__main__":
    main()
