"""mpirun as the launcher's child: started in a session of its own and bound to die with
the launcher, the launcher's signals passed on to it, its output split into per-rank
files (``--output-filename``), and the job's exit status read from the records the
ranks leave (job_status).

Signals. mpirun runs in a session of its own, so the terminal's signals reach only the
launcher, which passes them on; and on Linux mpirun cannot outlive the launcher:

* SIGINT, SIGTERM and SIGHUP are passed on to mpirun, which ends the job.
* SIGQUIT (Ctrl-\\) becomes SIGTERM for mpirun, which ends the job (a SIGQUIT would kill
  mpirun alone and leave its ranks running).
* SIGUSR1 and SIGUSR2 are passed on; mpirun relays them to every rank.
* SIGTSTP (Ctrl-Z) suspends the job as a whole, as a terminal user expects: mpirun
  stops every rank, then the launcher stops itself, so the shell reports the job
  stopped. SIGCONT (``fg``, ``bg``) to the launcher resumes the ranks. mpirun itself
  keeps running meanwhile, to relay that SIGCONT (and a SIGTERM) to the ranks.
* SIGKILL of the launcher, or any other way it dies, makes the kernel send mpirun
  SIGTERM (Linux parent-death signal), and mpirun ends the job. SIGTERM, not SIGKILL:
  a SIGKILLed mpirun leaves its ranks running.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading

# What mpirun gets for each signal the launcher receives. Open MPI's mpirun ends the job
# on SIGINT/SIGTERM/SIGHUP and relays SIGUSR1/SIGUSR2/SIGTSTP/SIGCONT to the ranks, but
# SIGQUIT kills it alone and leaves the ranks running, so a quit becomes a termination.
SIGNALS_FOR_MPIRUN = {
    signal.SIGINT: signal.SIGINT,
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGHUP: signal.SIGHUP,
    signal.SIGQUIT: signal.SIGTERM,
    signal.SIGUSR1: signal.SIGUSR1,
    signal.SIGUSR2: signal.SIGUSR2,
    signal.SIGTSTP: signal.SIGTSTP,
    signal.SIGCONT: signal.SIGCONT,
}
# Every signal either launcher passes on (the direct launcher's are among these).
PASSED_ON = frozenset(SIGNALS_FOR_MPIRUN)
# Sent to mpirun by the kernel when the launcher dies; mpirun then ends its ranks.
MPIRUN_DEATH_SIGNAL = signal.SIGTERM
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@contextlib.contextmanager
def signals_to_main_thread():
    """Threads started inside never take a signal the launcher passes on. The kernel
    gives a process's signal to any thread not blocking it; one taken by another thread
    can reach the main thread's handler after a signal sent later (SIGUSR1 then SIGTERM
    reached a rank as SIGTERM first). With the main thread alone taking them, signals
    pending together are handled lowest number first, and the rest in the order sent."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, PASSED_ON)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def start_thread(target, *args, name: str | None = None) -> threading.Thread:
    """A daemon thread of the launcher's, blind to its signals (signals_to_main_thread)."""
    with signals_to_main_thread():
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
    return thread


def death_signal_setter(signum: int):
    """A preexec_fn making the kernel send ``signum`` to the child when the launcher dies,
    or None where there is no prctl (not Linux).

    This is the only way to reach mpirun after a SIGKILL of the launcher, which no
    handler sees. The kernel sends it when the *thread* that started the child ends: the
    main thread, which lives as long as the launcher. prctl is looked up here, before the
    fork, so that between fork and exec the child loads nothing.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher_pid = os.getpid()

    def set_death_signal():
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != launcher_pid:
            # The launcher died before prctl took effect: no signal will ever come.
            os._exit(128 + int(signum))

    return set_death_signal


def start_mpirun(command: list[str], piped: bool = False) -> subprocess.Popen:
    """Start mpirun in a session of its own (the terminal's signals reach only the launcher,
    which decides what mpirun gets), bound to die with the launcher. ``piped``: its stdout
    and stderr come to us (OutputFiles)."""
    pipe = subprocess.PIPE if piped else None
    return subprocess.Popen(command, start_new_session=True, stdout=pipe, stderr=pipe,
                            preexec_fn=death_signal_setter(MPIRUN_DEATH_SIGNAL))


def stop_launcher() -> None:
    """Stop this process, as SIGTSTP's default action would. SIGSTOP, not SIGTSTP: the
    kernel drops SIGTSTP in an orphaned process group, which would leave the ranks stopped
    under a running launcher."""
    os.kill(os.getpid(), signal.SIGSTOP)


def pass_on(mpirun: subprocess.Popen, signum: int) -> None:
    """Give mpirun what ``signum`` means for it (SIGNALS_FOR_MPIRUN); after SIGTSTP, once
    mpirun has been told to stop the ranks, stop the launcher too."""
    if mpirun.returncode is None:  # once reaped, its pid may belong to someone else
        try:
            os.killpg(mpirun.pid, SIGNALS_FOR_MPIRUN[signum])
        except ProcessLookupError:
            pass
    if signum == signal.SIGTSTP:
        stop_launcher()


class OutputFiles:
    """``--output-filename DIR`` under Open MPI: every line mpirun prints still reaches the
    console, and each rank's lines (told apart by --tag-output's ``[job,rank]<stream>:``)
    also go, untagged, to ``DIR/rank.<r>/stdout`` or ``stderr`` (r zero-padded to the width
    of the largest rank, as horovodrun's Gloo launcher). Open MPI 5's own
    --output-filename names files after mpirun's pid and prints nothing on the console."""

    TAG = re.compile(rb"^(?:\[[^\]]*\])?\[\d+,(\d+)\]<(stdout|stderr)>: ?")

    def __init__(self, directory: str, np: int):
        self.directory, self.width = directory, len(str(max(np - 1, 0)))
        self.files, self.lock = {}, threading.Lock()
        self.threads = []

    def file_for(self, rank: int, stream: str):
        key = (rank, stream)
        with self.lock:
            if key not in self.files:
                folder = os.path.join(self.directory, "rank.%0*d" % (self.width, rank))
                os.makedirs(folder, exist_ok=True)
                self.files[key] = open(os.path.join(folder, stream), "wb")
            return self.files[key]

    def pump(self, source, console) -> None:
        for line in iter(source.readline, b""):
            console.write(line)
            console.flush()
            match = self.TAG.match(line)
            if match:
                f = self.file_for(int(match.group(1)), match.group(2).decode())
                f.write(line[match.end():])
                f.flush()

    def start(self, mpirun: subprocess.Popen) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for source, console in ((mpirun.stdout, sys.stdout), (mpirun.stderr, sys.stderr)):
            sink = getattr(console, "buffer", console)
            self.threads.append(start_thread(self.pump, source, sink))

    def close(self) -> None:
        for thread in self.threads:
            thread.join(timeout=10)
        for f in self.files.values():
            f.close()


def run_forwarding_signals(command: list[str], output: OutputFiles | None = None,
                           diagnostics=None) -> int:
    """Run ``command`` (mpirun) and return its exit status, passing signals on as the
    module docstring describes; with ``output``, mpirun's output goes through it.

    Each signal we get is passed on once to mpirun's process group (Open MPI puts each
    rank in a group of its own), and mpirun acts on the ranks itself. A child killed by
    signal N yields 128 + N, like a shell. With ``diagnostics``
    (launch.diagnostics.JobDiagnostics) the first SIGINT asks for a hang report first.
    """
    job = {"mpirun": None, "pending": []}

    def on_signal(signum, _frame):
        mpirun = job["mpirun"]
        if signum == signal.SIGINT and mpirun is not None and diagnostics is not None and \
                diagnostics.first_interrupt(lambda: pass_on(mpirun, signal.SIGUSR1),
                                            lambda: pass_on(mpirun, signal.SIGINT)):
            return
        if job["mpirun"] is not None:
            pass_on(job["mpirun"], signum)
        elif signum == signal.SIGCONT:
            # Resumed before mpirun existed: the stop asked for meanwhile is void.
            job["pending"] = [s for s in job["pending"] if s != signal.SIGTSTP]
        else:
            job["pending"].append(signum)  # replayed once mpirun exists

    previous = {sig: signal.signal(sig, on_signal) for sig in SIGNALS_FOR_MPIRUN}
    try:
        job["mpirun"] = start_mpirun(command, piped=output is not None)
        if output is not None:
            output.start(job["mpirun"])
        for signum in job["pending"]:
            pass_on(job["mpirun"], signum)
        returncode = job["mpirun"].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if output is not None:
            output.close()
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------- the job's status
# Under MPI fault tolerance (--elastic: mpirun --with-ft ulfm) a failing rank kills itself,
# so that the others can recover without it, and mpirun reports success once no rank is
# left, even when every rank failed. So each rank records how it ends in a directory the
# launcher gives it (ringsync.bootstrap.record_job_event), and the launcher decides.

CAUSE_SHOWN = 160  # characters of each failure's cause in the launcher's message


@dataclasses.dataclass
class RankHistory:
    """What one process (a rank, or a replacement) recorded: its latest record of each
    kind ("started", "failed", "left", "finished")."""

    rank: int | None
    spawned: bool
    pid: int
    records: dict = dataclasses.field(default_factory=dict)

    def ending(self) -> str | None:
        """How it ended: "failed", "left", "finished", or None if it recorded no end
        after its latest start (killed from outside, or ended without Python's exit)."""
        ends = [r for kind, r in self.records.items() if kind != "started"]
        if not ends:
            return None
        last = max(ends, key=lambda r: r["time_ns"])
        started = self.records.get("started")
        if started and started["time_ns"] > last["time_ns"]:
            return None
        return last["kind"]

    def name(self) -> str:
        if self.spawned or self.rank is None:
            return "a replacement rank (pid %d)" % self.pid
        return "rank %d" % self.rank

    def problem(self) -> str:
        if self.ending() == "failed":
            cause = self.records["failed"].get("cause")
            if cause and len(cause) > CAUSE_SHOWN:
                cause = cause[:CAUSE_SHOWN] + "..."
            return "%s failed" % self.name() + (" (%s)" % cause if cause else "")
        return "%s ended without a record (killed by a signal, or by mpirun)" % self.name()


def read_job_records(directory: str | None) -> list[dict]:
    """The records the ranks left in ``directory`` (unreadable ones skipped)."""
    records = []
    for name in sorted(os.listdir(directory)) if directory else []:
        if name.startswith(".") or not name.endswith(".json"):
            continue  # (a record still being written)
        try:
            with open(os.path.join(directory, name)) as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            continue
    return records


def rank_histories(records: list[dict]) -> list[RankHistory]:
    """One history per process, in rank order (replacements last)."""
    by_process = {}
    for record in records:
        key = (record.get("host"), record.get("pid"))
        if key not in by_process:
            by_process[key] = RankHistory(record.get("rank"), bool(record.get("spawned")),
                                          record.get("pid") or 0)
        by_process[key].records[record["kind"]] = record
    return sorted(by_process.values(),
                  key=lambda h: (h.spawned or h.rank is None, h.rank or 0, h.pid))


def job_status(mpirun_status: int, records: list[dict]) -> tuple[int, str | None]:
    """The launcher's exit status and a one-line message naming the failed ranks, or None.

    mpirun's own failure wins. Otherwise the job failed when a rank failed, or ended with
    no record (killed from outside), and no rank finished after the last recorded
    failure: elastic survivors that finish are the job finishing."""
    histories = rank_histories(records)
    failed = sorted((h for h in histories if h.ending() in ("failed", None)),
                    key=failure_order)
    problems = "; ".join(h.problem() for h in failed)
    if mpirun_status != 0:
        if not histories:
            return mpirun_status, None  # not a ringsync program: mpirun speaks for it
        return mpirun_status, ("ringsync run: the job failed (exit status %d)%s"
                               % (mpirun_status, ": " + problems if problems else ""))
    if not failed or finished_after_failures(histories):
        return 0, None
    return 1, ("ringsync run: the job failed: %s; no rank finished after that (mpirun "
               "reported success: under MPI fault tolerance it does once no rank is left)"
               % problems)


def failure_order(history: RankHistory):
    """The first failure first (often the cause of the others); unrecorded ends last."""
    if history.ending() == "failed":
        return (0, history.records["failed"]["time_ns"])
    return (1, 0)


def finished_after_failures(histories: list[RankHistory]) -> bool:
    """Whether some rank finished after the last recorded failure."""
    failures = [h.records["failed"]["time_ns"] for h in histories if h.ending() == "failed"]
    last_failure = max(failures, default=-1)
    return any(h.ending() == "finished" and h.records["finished"]["time_ns"] > last_failure
               for h in histories)
