"""Run a function or script on several MPI ranks and collect every rank's outcome.

Made for pytest (ringsync's own multi-rank tests use it) and offered to users for CI.
Most tests want the pytest marker (ringsync.pytest_plugin), which runs the test function
itself on the ranks::

    @pytest.mark.ranks(4)
    def test_allreduce():
        ...  # runs on each of 4 ranks

Tests that must watch the job from outside (a rank killed on purpose, files or processes
left behind) call run_mpi with a function, or with its "module:function" name::

    result = run_mpi(body_that_kills_rank_1, np=4, timeout=60)
    assert not result.timed_out, result.report()

Each rank runs ``python -m ringsync.testing <resultdir> <target> [args...]`` under
mpirun. A rank that finishes writes ``rank<r>.ok``; a rank that raises prints its
traceback, writes it to ``rank<r>.err`` and dies hard with ``os._exit(1)`` (by SIGKILL
under MPI fault tolerance), never sitting in MPI_Finalize while its peers wait, so
mpirun ends the job or elastic peers recover. A deadline turns a hang
into a failure: every rank first dumps its Python stacks, then the job is killed.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import importlib.util
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from ringsync.launch import mpirun as launcher
# Offered here to users' tests (ringsync.testing is the public module).
from ringsync.netns import VirtualHosts, unavailable as virtual_hosts_unavailable  # noqa: F401

OK = "ok"
MISSING = "missing"
OUTPUT_LIMIT = 20000
STACK_DUMP_SIGNAL = signal.SIGUSR1
STACK_DUMP_GRACE_S = 1.5  # time for dumped stacks to travel through mpirun to us
TERMINATE_GRACE_S = 5.0  # time mpirun gets to tear the ranks down after SIGTERM
RESULT_FILE = re.compile(r"^rank(-?\d+)\.(ok|err)$")
PID_DIR = "pids"
# Set in every rank this module starts, so code (and ringsync's pytest plugin) can tell.
RANK_ENV = "RINGSYNC_TESTING_RANK"


# =========================================================================== caller side


@dataclasses.dataclass
class MPIResult:
    """What happened to one multi-rank run."""

    target: str
    np: int
    command: list[str]
    returncode: int | None
    output: str  # combined stdout/stderr of all ranks, each line tagged with its rank
    outcomes: dict[int, str]  # rank -> "ok", its traceback text, or "missing"
    timed_out: bool
    timeout: float
    leftover_pids: list[int] = dataclasses.field(default_factory=list)  # alive after mpirun ended

    @property
    def ok(self) -> bool:
        return (
            not self.timed_out
            and self.returncode == 0
            and all(outcome == OK for outcome in self.outcomes.values())
        )

    def failed_ranks(self) -> list[int]:
        return sorted(rank for rank, outcome in self.outcomes.items() if outcome != OK)

    def summary(self) -> str:
        if self.timed_out:
            return "timed out after %gs (live ranks dumped their Python stacks into the output)" % self.timeout
        problems = []
        if self.returncode != 0:
            problems.append("mpirun exit status %s" % self.returncode)
        if self.failed_ranks():
            problems.append("ranks %s did not finish ok" % self.failed_ranks())
        return ", ".join(problems) or "all %d ranks ok" % self.np

    def report(self, output_limit: int = OUTPUT_LIMIT) -> str:
        """Every rank's outcome and the tail of the combined output, for a failure message."""
        lines = [
            "MPI job %r on %d ranks: %s" % (self.target, self.np, self.summary()),
            "command: " + shlex.join(self.command),
        ]
        for rank in sorted(self.outcomes):
            outcome = self.outcomes[rank]
            if outcome == OK:
                lines.append("--- rank %d: ok" % rank)
            elif outcome == MISSING:
                lines.append("--- rank %d: missing (no result: hung, killed, or never started)" % rank)
            else:
                lines.append("--- rank %d: FAILED\n%s" % (rank, outcome.rstrip()))
        output = self.output
        if len(output) > output_limit:
            output = "[... %d earlier characters cut ...]\n" % (len(output) - output_limit) + output[-output_limit:]
        lines.append("--- combined output ---\n" + output.rstrip())
        return "\n".join(lines)


def run_mpi(
    target,
    np: int = 2,
    timeout: float = 120,
    args=(),
    env: dict[str, str | None] | None = None,
    mpirun_args=(),
    expect_failure: bool = False,
    check: bool = False,
    wrapper=(),
    hosts=None,
    slots=1,
) -> MPIResult:
    """Run ``target`` on ``np`` ranks and return an MPIResult.

    target: a module-level function, or its name ``"package.module:function"`` (each rank
        imports it and calls it with ``*args``, as strings), or the path of a script (run
        as ``__main__`` with ``args`` in sys.argv).
    timeout: seconds for the whole job; past it ranks dump their stacks and are killed.
    env: variables to set for the ranks (a None value removes one).
    mpirun_args: extra mpirun options, placed before the program.
    check: raise AssertionError with the full report unless the job succeeded, or with
        ``expect_failure``, unless it failed (any rank not ok) without hitting the deadline.
    wrapper: a command that the mpirun command line is appended to and that runs in its
        place (e.g. ``unshare -m ...``).
    hosts: a VirtualHosts (ringsync.testing.VirtualHosts) to run the ranks on, ``slots``
        (an int, or one per host) ranks per host in host order; the ranks get the
        caller's PATH, PYTHONPATH and RINGSYNC_* variables and ``env``.
    """
    target = target_name(target)
    if hosts is not None:
        mpirun_args = hosts_mpirun_args(hosts, slots, env) + list(mpirun_args)
    for _ in range(LAUNCH_ATTEMPTS):
        result = _run_job(target, np, timeout, args, env, mpirun_args, wrapper)
        if not _launcher_failed(result):
            break
    if check:
        check_result(result, expect_failure)
    return result


def target_name(target) -> str:
    """A function becomes "module:qualname", the name each rank imports it by."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<locals>" in qualname:
        raise ValueError("ranks import the target by name: %r must be defined at the top "
                         "level of an importable module" % (target,))
    return "%s:%s" % (module, qualname)


# Open MPI's launcher itself sometimes fails to start (seen: "The PMIx server's listener
# thread failed to start", exit 213) before any rank runs; such a job is started again.
LAUNCH_ATTEMPTS = 2
LAUNCHER_FAILURES = ("PMIx server's listener thread failed to start",)


def _launcher_failed(result: "MPIResult") -> bool:
    return (result.returncode != 0 and not result.timed_out and
            all(outcome == MISSING for outcome in result.outcomes.values()) and
            any(text in result.output for text in LAUNCHER_FAILURES))


def _run_job(target, np, timeout, args, env, mpirun_args, wrapper=()) -> "MPIResult":
    resultdir = tempfile.mkdtemp(prefix="ringsync-mpi-")
    try:
        command = list(wrapper) + mpirun_command(np, list(mpirun_args),
                                                 worker_command(resultdir, target, args))
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child_environment(target, env),
            start_new_session=True,  # so a timeout can kill mpirun's whole group
        )
        output = OutputCollector(process.stdout)
        timed_out = not wait_for_exit(process, timeout)
        if timed_out:
            dump_rank_stacks(resultdir)
            time.sleep(STACK_DUMP_GRACE_S)
            terminate_job(process)
        leftovers = kill_leftover_ranks(resultdir)
        result = MPIResult(
            target=target,
            np=np,
            command=command,
            returncode=process.returncode,
            output=output.text(),
            outcomes=read_outcomes(resultdir, np),
            timed_out=timed_out,
            timeout=timeout,
            leftover_pids=leftovers,
        )
    finally:
        shutil.rmtree(resultdir, ignore_errors=True)
    return result


def assert_mpi_ok(target, np: int = 2, **kwargs) -> MPIResult:
    """run_mpi that raises AssertionError (showing every rank) unless every rank succeeded."""
    return run_mpi(target, np=np, check=True, **kwargs)


def assert_mpi_fails(target, np: int = 2, **kwargs) -> MPIResult:
    """run_mpi that raises AssertionError unless the job failed promptly (not by the deadline)."""
    return run_mpi(target, np=np, check=True, expect_failure=True, **kwargs)


def check_result(result: MPIResult, expect_failure: bool) -> None:
    if result.timed_out:
        raise AssertionError(result.report())
    if expect_failure and result.ok:
        raise AssertionError("expected a failure, but:\n" + result.report())
    if not expect_failure and not result.ok:
        raise AssertionError(result.report())


def worker_command(resultdir: str, target: str, args) -> list[str]:
    if is_script(target):
        target = os.path.abspath(target)
    return [sys.executable, "-m", "ringsync.testing", resultdir, target] + [str(a) for a in args]


def hosts_mpirun_args(hosts, slots, env) -> list[str]:
    """Where the ranks run, how mpirun reaches the hosts, and what they inherit (a rank
    started through a launch agent gets only the variables mpirun exports)."""
    names = ["PATH", "PYTHONPATH", "PYTHONUNBUFFERED"] + list(env or {})
    names += launcher.exported_variables(child_environment("", env))
    exports = []
    for name in dict.fromkeys(names):
        if (env or {}).get(name, "") is not None:
            exports += ["-x", name]
    return ["-H", hosts.hosts_arg(slots)] + hosts.mpirun_args() + exports


def mpirun_command(np: int, mpirun_args: list[str], worker: list[str]) -> list[str]:
    mpirun = launcher.find_mpirun()
    flavor = launcher.mpi_flavor(mpirun)
    # Tests always allow oversubscription: CI machines have few cores.
    hosts_given = "-H" in mpirun_args or "--hostfile" in mpirun_args
    command = [mpirun, "-np", str(np)] + launcher.policy_flags(
        flavor, oversubscribe=True, hosts_given=hosts_given and "--map-by" not in mpirun_args)
    if flavor == launcher.OPEN_MPI:
        command.append("--tag-output")
        if "--bind-to" not in mpirun_args:
            # Pinned ranks would share one core with the engine's background thread.
            command += ["--bind-to", "none"]
    elif flavor == launcher.MPICH:
        command.append("-l")  # Hydra's rank-prefixed output
    return command + mpirun_args + worker


def package_root() -> str:
    """The directory holding the ringsync package this process uses."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def target_root(target: str) -> str | None:
    """The sys.path entry the caller imports the target's top-level package from.

    Under pytest that is the rootdir pytest inserted into sys.path, which ranks would
    not otherwise have.
    """
    if is_script(target) or ":" not in target:
        return None
    top = target.split(":", 1)[0].split(".", 1)[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        location = list(spec.submodule_search_locations)[0]
    elif spec.origin and os.path.isabs(spec.origin):
        location = spec.origin
    else:
        return None
    return os.path.dirname(os.path.abspath(location))


def child_environment(target: str, extra: dict[str, str | None] | None) -> dict[str, str]:
    """os.environ, plus what ranks need to import the target and find the right MPI."""
    env = dict(os.environ)
    # mpirun starts its helpers by name: the venv's Open MPI must come first.
    env["PATH"] = os.pathsep.join(
        [os.path.dirname(sys.executable)] + [p for p in env.get("PATH", "").split(os.pathsep) if p]
    )
    paths = [os.getcwd(), target_root(target), package_root()]
    paths += env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the report even from a rank that is killed
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


class OutputCollector:
    """Reads a pipe on a thread, so mpirun never blocks on a full pipe while we wait."""

    def __init__(self, pipe):
        self._pipe = pipe
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for chunk in iter(lambda: self._pipe.read1(65536), b""):
            self._chunks.append(chunk)

    def text(self, wait_s: float = 5.0) -> str:
        self._thread.join(wait_s)
        return b"".join(self._chunks).decode("utf-8", errors="replace")


def wait_for_exit(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_job(process: subprocess.Popen) -> None:
    """Stop mpirun: SIGTERM first (it then stops the ranks itself), SIGKILL if it lingers."""
    signal_group(process, signal.SIGTERM)
    if not wait_for_exit(process, TERMINATE_GRACE_S):
        signal_group(process, signal.SIGKILL)
        process.wait()


def rank_pids(resultdir: str) -> list[int]:
    try:
        return [int(name) for name in os.listdir(os.path.join(resultdir, PID_DIR))]
    except OSError:
        return []


def is_our_worker(pid: int, resultdir: str) -> bool:
    """Whether ``pid`` still runs a worker of this job (pids get reused)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return resultdir.encode() in f.read()
    except OSError:
        pass
    try:  # no /proc (macOS)
        command = subprocess.run(["ps", "-o", "command=", "-p", str(pid)],
                                 capture_output=True, text=True).stdout
    except OSError:
        return False
    return resultdir in command


def signal_ranks(resultdir: str, signum: int) -> list[int]:
    signalled = []
    for pid in rank_pids(resultdir):
        if is_our_worker(pid, resultdir):
            try:
                os.kill(pid, signum)
                signalled.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return signalled


def dump_rank_stacks(resultdir: str) -> None:
    """Ask every live rank to print its Python stacks (they show where a hang is)."""
    signal_ranks(resultdir, STACK_DUMP_SIGNAL)


def kill_leftover_ranks(resultdir: str, wait_s: float = 5.0) -> list[int]:
    """SIGKILL ranks that outlived mpirun and wait until they are gone; returns their pids.

    Open MPI puts each rank in its own process group, so killing mpirun's group does not
    reach them, and a rank orphaned by a killed mpirun would otherwise run forever.
    """
    deadline = time.monotonic() + wait_s
    leftovers = signal_ranks(resultdir, signal.SIGKILL)
    while signal_ranks(resultdir, signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(0.05)
    return leftovers


def read_outcomes(resultdir: str, np: int) -> dict[int, str]:
    outcomes = {rank: MISSING for rank in range(np)}
    for name in sorted(os.listdir(resultdir)):
        match = RESULT_FILE.match(name)
        if not match:
            continue
        rank, kind = int(match.group(1)), match.group(2)
        if kind == "ok":
            outcomes[rank] = OK
        else:
            with open(os.path.join(resultdir, name), errors="replace") as f:
                outcomes[rank] = f.read() or "failed (empty traceback)"
    return outcomes


# =========================================================================== rank side


def is_script(target: str) -> bool:
    return target.endswith(".py") or os.path.isfile(target)


def write_atomically(path: str, text: str) -> None:
    """Write then rename, so the caller never reads half a result."""
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def record_pid(resultdir: str) -> None:
    """Leave our pid where the caller can find it, in case mpirun dies before us."""
    pid_dir = os.path.join(resultdir, PID_DIR)
    os.makedirs(pid_dir, exist_ok=True)
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()


def world_rank() -> int:
    """This process's rank in MPI_COMM_WORLD (initialises MPI, as the target would)."""
    try:
        from mpi4py import MPI
    except Exception:
        # Still attribute the failure to a rank, using the launcher's variables.
        for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
            if os.environ.get(name, "").isdigit():
                return int(os.environ[name])
        return -1
    finally:
        # MPI_Init may install its own handlers; keep stack dumps working.
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:
        return -2  # a replacement started by elastic recovery (--respawn)
    return MPI.COMM_WORLD.Get_rank()


def resolve_function(target: str):
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError("target %r is neither a script nor 'module:function'" % target)
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def run_target(target: str, args: list[str]) -> None:
    if is_script(target):
        sys.argv = [target] + args
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script`
        runpy.run_path(target, run_name="__main__")
    else:
        resolve_function(target)(*args)


def fail_hard(resultdir: str, rank: int, text: str) -> None:
    """Report and exit at once: a failed rank must look dead to its peers, not wait in
    MPI_Finalize for them (under MPI fault tolerance it is killed, as ringsync's own
    handler does, so that elastic peers recover without it)."""
    from ringsync import bootstrap

    sys.stderr.write(text)
    write_atomically(os.path.join(resultdir, "rank%d.err" % rank), text)
    bootstrap.exit_as_failed()


def worker_main(argv: list[str]) -> None:
    resultdir, target, args = argv[0], argv[1], argv[2:]
    os.environ[RANK_ENV] = "1"
    record_pid(resultdir)
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    rank = -1
    try:
        rank = world_rank()
        run_target(target, args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            fail_hard(resultdir, rank, "SystemExit: %r\n%s" % (exc.code, traceback.format_exc()))
    except BaseException:
        fail_hard(resultdir, rank, traceback.format_exc())
    write_atomically(os.path.join(resultdir, "rank%d.ok" % rank), "ok\n")


if __name__ == "__main__":
    worker_main(sys.argv[1:])
