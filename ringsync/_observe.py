"""Seeing inside a job, for one ring (NativeRing): its flight records as data and as the
file a failure leaves, the straggler report, and this rank's part of a hang report.

The native engine keeps the records (records.c) and agrees with its peers when a hang
report is due (a stall, or a request riding on a negotiation round); an Observer thread
per ring waits for those reports, writes this rank's part, and on rank 0 logs stragglers.
The thread only reads the engine: the ring stops it before freeing the engine.
"""
import json
import os
import signal
import sys
import tempfile
import threading
import time


from ._arrays import DTYPE_CODES
from ._atomic import write_atomically
from ._native import ffi, lib
from .errors import UsageError
from .ops import ReduceOp

FORMAT_VERSION = 1
_KIND_NAMES = {lib.RS_KIND_ALLREDUCE: "allreduce", lib.RS_KIND_ALLGATHER: "allgather",
               lib.RS_KIND_BROADCAST: "broadcast", lib.RS_KIND_REDUCESCATTER: "reducescatter",
               lib.RS_KIND_ALLTOALL: "alltoall", lib.RS_KIND_BARRIER: "barrier",
               lib.RS_KIND_JOIN: "join", lib.RS_KIND_SEND: "send", lib.RS_KIND_RECV: "recv",
               lib.RS_KIND_TUNE: "tune", lib.RS_KIND_REFUSED: "refused"}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
_OP_NAMES = {int(op): op.name.lower() for op in ReduceOp}
_REDUCING = ("allreduce", "reducescatter")
_RESULTS = {lib.RS_OK: "ok", lib.RS_FLIGHT_RUNNING: "running",
            lib.RS_ERR_USAGE: "MismatchError", lib.RS_ERR_NOMEM: "OutOfMemoryError",
            lib.RS_ERR_COMM: "CommunicationError", lib.RS_ERR_TIMEOUT: "CommunicationTimeout",
            lib.RS_ERR_SYSTEM: "CommunicationError"}
_REASONS = {lib.RS_REPORT_STALL: "stall", lib.RS_REPORT_REQUEST: "request"}
_RECENT_IN_HANG_REPORT = 12
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _wall_offset() -> float:
    """What to add to the engine's monotonic times to read them as Unix time."""
    return time.time() - lib.rs_monotonic_seconds()


def _record_dict(r, offset: float, process_set: int) -> dict:
    kind = _KIND_NAMES.get(r.kind, str(r.kind))
    return {"seq": int(r.seq), "set": process_set, "name": ffi.string(r.name).decode(
                "utf-8", "replace"), "kind": kind,
            "op": _OP_NAMES.get(r.op) if kind in _REDUCING else None,
            "dtype": _DTYPE_NAMES.get(r.dtype, str(r.dtype)) if kind != "barrier" else None,
            "shape": [int(d) for d in r.shape[0:max(0, min(r.ndim, 8))]],
            "root": int(r.root) if kind == "broadcast" else None,
            "route": "lane" if r.route == lib.RS_ROUTE_LANE else "engine",
            "start": r.start + offset, "end": r.end + offset if r.end else None,
            "result": _RESULTS.get(r.status, f"status {r.status}")}


def flight_records(engine, capacity: int, process_set: int = 0) -> list:
    """The engine's flight records (at most capacity), oldest first, as dicts (Unix
    times)."""
    if engine == ffi.NULL or capacity <= 0:
        return []
    out = ffi.new("rs_flight_record_t[]", capacity)
    n = lib.rs_engine_flight_records(engine, out, capacity)
    offset = _wall_offset()
    return [_record_dict(out[i], offset, process_set) for i in range(n)]


# Held while a thread of this process writes flight records, and by SIGTERM's ending from
# its write until the process is gone: a failure's write on another thread (a peer that
# the same SIGTERM ended) then either finished before or never starts, and no half-written
# temporary file is left behind. (Process-wide: the files and the exit are.)
RECORDS_WRITE_LOCK = threading.RLock()


def leave_flight_records(ring, why: str, rank: int) -> None:
    """Write the ring's flight records to RINGSYNC_FLIGHT_RECORDER_DIR/rank-<rank>.json
    (nothing where it is unset), for `ringsync trace`."""
    directory = ring.config.flight_recorder_dir
    if not directory or ring.closed:
        return
    document = {"format": "ringsync-flight-recorder", "version": FORMAT_VERSION,
                "rank": rank, "size": ring.size, "host": ring.host_names[ring.rank],
                "pid": os.getpid(), "written_at": time.time(), "why": why,
                "records": flight_records(ring.engine, ring.config.flight_recorder_size)}
    path = os.path.join(directory, f"rank-{rank}.json")
    try:
        with RECORDS_WRITE_LOCK:
            write_json(path, document)
    except OSError as e:
        print(f"ringsync: rank {rank}: cannot write its flight records {path}: {e}",
              file=sys.stderr, flush=True)


def write_json(path: str, document: dict) -> None:
    """Whole or not at all (a reader never sees half a file); the directory is made."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomically(path, json.dumps(document, indent=1).encode())


STRAGGLER_EVENTS = 8192  # what the engine keeps (engine.c STRAGGLER_EVENTS)


def _sparse_stats(nonzero: list, window: int) -> tuple:
    """(mean, p50, p95) of `window` values of which all but `nonzero` are 0, without
    building the vector (numpy's linear interpolation between order statistics)."""
    ordered = sorted(nonzero)
    zeros = window - len(ordered)

    def at(index: int) -> float:
        return 0.0 if index < zeros else ordered[index - zeros]

    def percentile(p: float) -> float:
        position = p / 100 * (window - 1)
        low = int(position)
        high = min(low + 1, window - 1)
        return at(low) + (at(high) - at(low)) * (position - low)
    return sum(ordered) / window, percentile(50), percentile(95)


def _kept_events(engine):
    """(events, rounds counted) the engine keeps; the window may not reach back past the
    oldest kept round once the ring of events has wrapped (its earlier events are gone)."""
    events = ffi.new("rs_wait_event_t[]", STRAGGLER_EVENTS)
    rounds = ffi.new("uint64_t *")
    n = lib.rs_engine_wait_events(engine, events, STRAGGLER_EVENTS, rounds) \
        if engine != ffi.NULL else 0
    oldest = int(events[0].round) + 1 if n == STRAGGLER_EVENTS else 1
    return [events[i] for i in range(n)], int(rounds[0]), oldest


def straggler_report(engine, host_names, last: int = 200) -> list:
    """Per rank, the wait it caused the others over the last `last` negotiation rounds
    that ran collectives (fewer where the engine has not run or kept that many): mean,
    median and 95th percentile per round (ms), how many of those rounds it came last in,
    and its host."""
    size = len(host_names)
    events, rounds, oldest = _kept_events(engine)
    first = max(rounds - last + 1, oldest, 1)
    window = max(rounds - first + 1, 0)
    waits = {}  # rank -> the waits it caused (rounds without one count as 0)
    for e in events:
        if e.round >= first and 0 <= e.rank < size:
            waits.setdefault(e.rank, []).append(e.wait_seconds * 1e3)
    report = []
    for r in range(size):
        caused = waits.get(r, [])
        mean, p50, p95 = _sparse_stats(caused, window) if window else (0.0, 0.0, 0.0)
        report.append({"rank": r, "host": host_names[r], "mean_ms": mean, "p50_ms": p50,
                       "p95_ms": p95, "rounds_last": len(caused), "rounds": window})
    return report


def straggler_line(report: list, threshold_ms: float):
    """The log line about the worst straggler, or None when nobody kept the others
    waiting more than threshold_ms per round."""
    worst = max(report, key=lambda row: row["mean_ms"], default=None)
    if worst is None or worst["rounds"] == 0 or worst["mean_ms"] <= threshold_ms:
        return None
    return (f"ringsync: rank {worst['rank']} (host {worst['host']}) kept the others waiting "
            f"{worst['mean_ms']:.0f} ms per round (p95 {worst['p95_ms']:.0f} ms) over the last "
            f"{worst['rounds']} rounds; it came last in {worst['rounds_last']} of them")


class JobInsight:
    """A Communicator's view into its job: flight records, the straggler report, hang
    reports (a mixin: the methods need its _ring, host_names and world_rank())."""

    _records_left = False  # this Communicator has written its flight records

    def _leave_flight_records(self, why) -> None:
        """A collective failed (or the ring is aborted): write the flight records where
        RINGSYNC_FLIGHT_RECORDER_DIR says, for `ringsync trace`."""
        text = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        leave_flight_records(self._ring, text, self.world_rank())
        self._records_left = True

    def _leave_flight_records_once(self, why: str) -> None:
        """At an abort: unless a failure's own records (which say more) are there."""
        if not self._records_left:
            self._leave_flight_records(why)

    def traffic(self) -> dict:
        """A debug counter: the bytes this rank has sent to each rank during collectives,
        by transport — {"tcp": [to rank 0, 1, ...], "shm": [...]} (shared-memory rings with
        same-host peers). Setup and wake-ups are not counted, nor the same-host lane and
        staged allreduce, which work in shared areas (only with every rank on one host)."""
        return self._ring.traffic()

    def flight_records(self) -> list:
        """This rank's last collectives (RINGSYNC_FLIGHT_RECORDER_SIZE of them), oldest
        first: name, kind, op, dtype, shape, route, start and end (Unix seconds; end None
        while running) and result ("ok", "running", or the error class it ended in)."""
        return flight_records(self._ring.engine, self.config.flight_recorder_size)

    def straggler_report(self, last: int = 200) -> list:
        """Per rank (a dict each, in rank order): how long it kept the others waiting per
        negotiation round over the last `last` rounds that ran collectives (mean_ms,
        p50_ms, p95_ms), in how many of them it came last (rounds_last), of how many
        (rounds), and its host. Every rank computes about the same from the rounds it
        took part in (no synchronized clocks needed)."""
        if int(last) < 1:
            raise UsageError(f"ringsync.straggler_report: last must be at least 1, got {last!r}")
        return straggler_report(self._ring.engine, self.host_names, int(last))

    def request_hang_report(self) -> None:
        """Ask every rank for its part of a hang report (what SIGUSR1 does): the request
        rides on the next negotiation round, which this rank's engine starts at once."""
        if self._ring.observer is not None:
            self._ring.observer.request_report()


# ---- this rank's part of a hang report ----

def _in_package(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _frames(frame) -> list:
    """Outermost first."""
    stack = []
    while frame is not None:
        code = frame.f_code
        stack.append({"file": code.co_filename, "line": frame.f_lineno,
                      "function": code.co_name})
        frame = frame.f_back
    return stack[::-1]


def _where(stack: list):
    """The innermost frame outside ringsync and the threading module: the user's line."""
    for frame in reversed(stack):
        if not _in_package(frame["file"]) and not frame["file"].endswith("threading.py"):
            return frame
    return stack[-1] if stack else None


def thread_stacks(skip_ident=None) -> list:
    """Every thread's Python stack (sys._current_frames: the documented way to read
    other threads' frames), the user's line in each, and whether it waits in ringsync."""
    names = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        stack = _frames(frame)
        thread = names.get(ident)
        if thread is not None and thread.name.startswith("ringsync-"):
            continue  # (ringsync's own helpers say nothing about where the user is)
        threads.append({"name": thread.name if thread else str(ident), "main": ident == main,
                        "waits_in_ringsync": any(_in_package(f["file"]) for f in stack),
                        "where": _where(stack), "stack": stack[-20:]})
    threads.sort(key=lambda t: not t["main"])
    return threads


def pending_snapshot(engine, size: int) -> list:
    """The tensors negotiation held when the report's snapshot was taken."""
    total = ffi.new("int *")
    lib.rs_engine_report_pending(engine, ffi.NULL, ffi.NULL, 0, total)
    capacity = total[0]
    if capacity == 0:
        return []
    items = ffi.new("rs_pending_info_t[]", capacity)
    flags = ffi.new("unsigned char[]", capacity * size)
    n = lib.rs_engine_report_pending(engine, items, flags, capacity, total)
    pending = []
    for i in range(n):
        row = bytes(ffi.buffer(flags + i * size, size))
        pending.append({"name": ffi.string(items[i].name).decode("utf-8", "replace"),
                        "kind": _KIND_NAMES.get(items[i].kind, str(items[i].kind)),
                        "set": 0, "submitted": [r for r in range(size) if row[r]],
                        "missing": [r for r in range(size) if not row[r]],
                        "waited": round(items[i].waited_seconds, 3),
                        "mine": bool(items[i].mine)})
    return pending


def default_report_dir(job_id: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"ringsync-hang-{job_id & (2**64 - 1):016x}")


class Observer:
    """The thread that serves one ring's hang reports and, on rank 0, logs stragglers.
    It waits in the engine (the GIL released) and wakes for a report, a straggler look,
    or stop()."""

    def __init__(self, ring, job_id: int):
        self.ring = ring
        self.config = ring.config
        self.report_dir = self.config.hang_report_dir or default_report_dir(job_id)
        self._stopped = False
        self._rounds_seen = 0
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"ringsync-observer-{ring.rank}")
        self._thread.start()

    def stop(self):
        """Before the engine is freed: the thread reads it."""
        if self._stopped:
            return
        self._stopped = True
        lib.rs_engine_interrupt_waits(self.ring.engine)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def request_report(self):
        if not self._stopped:
            lib.rs_engine_request_report(self.ring.engine, lib.RS_REPORT_REQUEST)

    def _straggler_period(self) -> float:
        seconds = self.config.straggler_report_seconds
        return seconds if self.ring.rank == 0 and seconds > 0 else 0.0

    def _serve(self):
        last, reason = 0, ffi.new("int *")
        period = self._straggler_period()
        next_look = time.monotonic() + period
        while not self._stopped:
            wait = max(0.0, next_look - time.monotonic()) if period else 3600.0
            report = lib.rs_engine_wait_report(self.ring.engine, last, wait, reason)
            if self._stopped:
                return
            if report:
                last = report
                self._answer_report(report, _REASONS.get(reason[0], "request"))
            if period and time.monotonic() >= next_look:
                next_look = time.monotonic() + period
                self._log_stragglers()

    def _log_stragglers(self):
        rounds = ffi.new("uint64_t *")
        lib.rs_engine_wait_events(self.ring.engine, ffi.NULL, 0, rounds)
        new_rounds, self._rounds_seen = int(rounds[0]) - self._rounds_seen, int(rounds[0])
        if new_rounds <= 0:
            return
        report = straggler_report(self.ring.engine, self.ring.host_names, new_rounds)
        line = straggler_line(report, self.config.straggler_threshold_ms)
        if line and self.config.logs("warning"):
            print(line, file=sys.stderr, flush=True)

    def _answer_report(self, report: int, reason: str):
        try:
            self._write_part(report, reason)
        except Exception as e:  # (a report must never end the rank; say why it is missing)
            print(f"ringsync: rank {self.ring.rank}: no part of hang report {report}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _write_part(self, report: int, reason: str):
        ring = self.ring
        part = {"format": "ringsync-hang-report", "version": FORMAT_VERSION, "report": report,
                "reason": reason, "rank": ring.rank, "size": ring.size,
                "host": ring.host_names[ring.rank], "pid": os.getpid(),
                "written_at": time.time(),
                "pending": pending_snapshot(ring.engine, ring.size),
                "threads": thread_stacks(skip_ident=threading.get_ident()),
                "recent": flight_records(ring.engine, self.config.flight_recorder_size)[
                    -_RECENT_IN_HANG_REPORT:]}
        path = os.path.join(self.report_dir, f"hang-{report}-rank-{ring.rank}.json")
        try:
            write_json(path, part)
        except OSError as e:
            print(f"ringsync: rank {ring.rank}: cannot write its hang report part {path}: {e}",
                  file=sys.stderr, flush=True)
            return
        if ring.rank == 0 and self.config.hang_report_merged_by.lower() != "launcher":
            self._print_merged(report)

    def _print_merged(self, report: int, patience: float = 3.0):
        """Rank 0 without a launcher that merges: the table, once every part is there (or
        after `patience` seconds, with what came; on other hosts parts stay there)."""
        from .diagnose.hang import count_hang_parts, format_hang_report, load_hang_parts
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline and not self._stopped:
            if count_hang_parts(self.report_dir).get(report, 0) >= self.ring.size:
                break
            time.sleep(0.1)
        try:
            _, parts = load_hang_parts(self.report_dir, report)
            text = format_hang_report(parts, self.ring.size)
        except Exception as e:  # (a report must never end the job)
            text = f"ringsync: hang report {report}: cannot merge the parts ({e})"
        print(f"{text}\nringsync: hang report {report} parts are in {self.report_dir} "
              f"(`ringsync report {self.report_dir}` merges them again)",
              file=sys.stderr, flush=True)


def install_report_signal(request) -> None:
    """SIGUSR1 calls request() (ask the job for a hang report), where nobody has claimed
    the signal: on the main thread only (Python's rule), never over a handler of the
    user's. The handler runs when the main thread next runs Python; one rank of the job
    suffices, so a rank blocked in a native wait does not hold the report up."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        # (ignored: as `ringsync run` starts its ranks, until now; a C handler, such as
        # faulthandler's stack dumps, is invisible to getsignal: the process is asked)
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN, None) and \
                lib.rs_signal_unclaimed(signal.SIGUSR1):
            signal.signal(signal.SIGUSR1, lambda *_: request())
    except (ValueError, OSError, AttributeError):
        pass


class TerminationRecords:
    """SIGTERM (a scheduler's time limit, `kill`, a launcher ending the job) leaves the
    flight records of the job's ring, then ends the process as SIGTERM would.

    Python runs a signal's handler only on the main thread, once it runs Python again:
    a rank blocked in a native wait would not. So the signal's wake-up byte
    (signal.set_wakeup_fd, written at once by Python's C-level handler) also wakes a
    thread of ours, which writes the records and ends the process (exit status 128 +
    SIGTERM, as a shell reports a death by it: a thread cannot restore the default action).
    Installed only on the main thread, where neither SIGTERM nor the wake-up fd is taken."""

    def __init__(self, leave_records):
        self._leave_records = leave_records  # leave_records(why): the job's ring's writer
        self._once = threading.Lock()
        self._read_fd = -1

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL or \
                not lib.rs_signal_unclaimed(signal.SIGTERM):
            return False  # (the program's own handler decides)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        if signal.set_wakeup_fd(write_fd) != -1:  # (taken: asyncio's, the program's)
            signal.set_wakeup_fd(-1)
            os.close(read_fd)
            os.close(write_fd)
            return False
        self._read_fd = read_fd
        signal.signal(signal.SIGTERM, self._on_main_thread)
        threading.Thread(target=self._watch, name="ringsync-sigterm", daemon=True).start()
        return True

    def _watch(self):
        while True:
            data = os.read(self._read_fd, 64)
            if not data:
                return
            if signal.SIGTERM in data:
                self._end(exit_thread=True)

    def _on_main_thread(self, signum, frame):
        self._end(exit_thread=False)

    def _end(self, exit_thread: bool):
        if not self._once.acquire(blocking=False):
            return  # (the other path is writing; it ends the process)
        RECORDS_WRITE_LOCK.acquire()  # (never released: held until the process ends)
        try:
            self._leave_records("terminated by SIGTERM")
        except Exception:
            pass  # (ending is what SIGTERM asked for)
        if exit_thread:
            os._exit(128 + signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
