"""``ringsync run --launcher local|ssh``: the ranks started without MPI.

The launcher serves the job's store (ringsync.store) and starts every rank itself: on this
host (``local``, as ``torchrun --nproc-per-node``) or on the hosts of ``-H`` through ssh,
or through a program called as ssh is (``--ssh-agent``: the namespace hosts of
ringsync.testing.VirtualHosts have one). Each rank finds the store through
RINGSYNC_RENDEZVOUS and its place through RANK / WORLD_SIZE / LOCAL_RANK (also what
torch.distributed's ``env://`` reads, with MASTER_ADDR / MASTER_PORT).

The job's secret is made here and never appears on a command line: a local rank reads it
from a file only the user can read (RINGSYNC_SECRET_FILE), a remote one from its ssh
connection's stdin (``python -m ringsync.launch.direct --secret-from-stdin -- PROGRAM``).

Every output line is tagged ``[rank]<stdout>:`` (``--output-filename`` also writes each
rank's own files); SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 are passed on to every
rank; when a rank fails the others are ended (without ``--elastic``) and the exit status
is the first failure's, with the failed ranks named. With ``--elastic`` the survivors go
on (ringsync.elastic over the store), ``--respawn`` starts a replacement for each rank
lost (up to ``--max-np`` ranks alive), and the job succeeded when a rank finished after
the last failure (the ranks' records, as under mpirun).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ringsync import bootstrap
from ringsync.errors import LauncherError
from ringsync.launch import mpirun, process
from ringsync.launch.hosts import host_entries
from ringsync.launch.mpirun import RunOptions

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
GRACE_S = 10.0  # a rank told to end (SIGTERM) is killed after this
POLL_S = 0.05
SECRET_OPTION = "--secret-from-stdin"


@dataclasses.dataclass
class Rank:
    """One process the launcher started: its label in the output, host, process, and how
    it ended (None while it runs)."""

    label: int
    host: str
    proc: subprocess.Popen
    replacement: bool = False
    status: int | None = None
    ended_by_launcher: bool = False
    ended_ns: int = 0  # when the launcher saw it end
    cause: str | None = None  # what it recorded when it failed


def slots_of(hosts: str | None, np: int) -> list[str]:
    """The host of each rank: -H's hosts slot by slot (``local``: this host)."""
    if not hosts:
        return ["localhost"] * np
    places = [name for name, slots in host_entries(hosts) for _ in range(slots)]
    if len(places) < np:
        raise LauncherError("-H %r has %d slots for -np %d" % (hosts, len(places), np))
    return places[:np]


class DirectJob:
    """A job whose ranks this launcher starts: the store, the ranks, their output, the
    signals passed on, replacements, and the exit status."""

    def __init__(self, options: RunOptions, status_dir: str, diagnostics=None):
        self.options, self.status_dir = options, status_dir
        self.diagnostics = diagnostics  # launch.diagnostics.JobDiagnostics, or None
        self.death_signal = process.death_signal_setter(signal.SIGTERM)
        self.remote = options.launcher == "ssh"
        self.places = slots_of(options.hosts if self.remote else None, options.np)
        self.secret = secrets.token_hex(32)
        self.workdir = tempfile.mkdtemp(prefix="ringsync-run-")
        self.secret_file = os.path.join(self.workdir, "secret")
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.secret)
        self.server = None
        self.ranks: list[Rank] = []
        self.output = None
        self.lock = threading.Lock()
        self.pumps: list[threading.Thread] = []
        self.replacements = 0

    # ---- the store ----

    def serve_store(self) -> str:
        from ringsync.store import StoreServer
        address = self.options.store_address or (
            bootstrap.routable_ipv4() if self.remote else "127.0.0.1")
        with process.signals_to_main_thread():  # (its threads too)
            self.server = StoreServer(self.secret.encode(),
                                      "0.0.0.0" if self.remote else address, 0,
                                      served_by="the launcher (ringsync run) on "
                                      + os.uname().nodename).start()
        return "tcp://%s:%d" % (address, self.server.address[1])

    # ---- starting ranks ----

    def rank_environment(self, rank: int | None, store_url: str) -> dict[str, str]:
        """The variables a rank gets on top of the launcher's environment (rank None: a
        replacement, whose place the job gives it)."""
        options = self.options
        values = mpirun.option_settings(options)
        if options.elastic:
            values.update(mpirun.elastic_settings(options))
            values["RINGSYNC_ELASTIC"] = "1"
        values.update({"RINGSYNC_RENDEZVOUS": store_url,
                       bootstrap.JOB_STATUS_DIR_ENV: self.status_dir,
                       "WORLD_SIZE": str(options.np),
                       "MASTER_ADDR": self.master_address(),
                       "MASTER_PORT": str(mpirun.free_port())})
        if rank is None:
            values["RINGSYNC_ELASTIC_JOIN"] = "1"
        else:
            host = self.places[rank]
            values.update({"RANK": str(rank),
                           "LOCAL_RANK": str(self.places[:rank].count(host)),
                           "LOCAL_WORLD_SIZE": str(self.places.count(host))})
        if not self.remote:
            values["RINGSYNC_SECRET_FILE"] = self.secret_file
        return values

    def master_address(self) -> str:
        return self.places[0] if self.remote else "127.0.0.1"

    def command_for(self, host: str, values: dict[str, str]) -> tuple[list[str], dict]:
        """(argv, environment) that start one rank on host."""
        program = list(self.options.program)
        if not self.remote:
            env = {k: v for k, v in os.environ.items() if k != "RINGSYNC_SECRET"}
            env.update(values)
            return list(program), env
        exported = {name: os.environ[name] for name in mpirun.exported_variables(os.environ)
                    if name in os.environ and name not in ("RINGSYNC_SECRET",
                                                            "RINGSYNC_SECRET_FILE")}
        exported.update(values)
        rank_argv = ["env"] + [f"{k}={v}" for k, v in exported.items()] + [
            sys.executable, "-m", "ringsync.launch.direct", SECRET_OPTION, "--"] + program
        command = shlex.join(["cd", os.getcwd()]) + " && exec " + shlex.join(rank_argv)
        return ssh_words(self.options, host) + [command], dict(os.environ)

    def start_rank(self, label: int, rank: int | None, store_url: str,
                   host: str | None = None) -> Rank:
        """Rank `rank` (None: a replacement, on `host`, the lost rank's)."""
        host = host or (self.places[rank] if self.remote else "localhost")
        argv, env = self.command_for(host, self.rank_environment(rank, store_url))
        proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                stdin=subprocess.PIPE if self.remote else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=self.rank_preexec)
        if self.remote:
            proc.stdin.write(self.secret.encode() + b"\n")
            proc.stdin.close()
        started = Rank(label, host, proc, replacement=rank is None)
        for source, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            self.pumps.append(process.start_thread(self.pump, label, source, stream))
        return started

    def rank_preexec(self) -> None:
        """In each rank before exec: it dies with the launcher, and ignores SIGUSR1 (a hang
        report's request) until ringsync.init() takes it over, so that a rank still
        importing does not die of it (an ignored signal stays ignored across exec)."""
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if self.death_signal is not None:
            self.death_signal()

    def pump(self, label: int, source, stream: str) -> None:
        console = getattr(getattr(sys, stream), "buffer", None) or sys.stdout.buffer
        tag = b"[%d]<%s>: " % (label, stream.encode())
        for line in iter(source.readline, b""):
            stamp = time.strftime("%a %b %d %H:%M:%S %Y").encode() + b" " \
                if self.options.prefix_output_with_timestamp else b""
            with self.lock:
                console.write(stamp + tag + line)
                console.flush()
            if self.output is not None:
                self.output.write_line(label, stream, line)

    # ---- running ----

    def run(self) -> int:
        if self.options.output_filename:
            self.output = RankFiles(self.options.output_filename, self.options.np)
        pending: list[int] = []

        def on_signal(signum, _frame):
            if signum == signal.SIGINT and self.diagnostics is not None and \
                    self.diagnostics.first_interrupt(lambda: pending.append(signal.SIGUSR1),
                                                     lambda: pending.append(signal.SIGINT)):
                return  # (a hang report first; the interrupt follows it)
            pending.append(signum)

        previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED}
        try:
            store_url = self.serve_store()
            self.ranks = [self.start_rank(r, r, store_url) for r in range(self.options.np)]
            self.supervise(pending, store_url)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.end_all(signal.SIGTERM)
            for pump in self.pumps:
                pump.join(timeout=5)
            if self.output is not None:
                self.output.close()
            if self.server is not None:
                self.server.close()
            _remove_tree(self.workdir)
        return self.exit_status()

    def supervise(self, pending: list[int], store_url: str) -> None:
        """Until every rank has ended: pass signals on, note each end, and end the job
        (or, elastic, start a replacement) when a rank fails."""
        while any(r.status is None for r in self.ranks):
            while pending:
                self.signal_all(pending.pop(0))
            for rank in self.ranks:
                if rank.status is None and rank.proc.poll() is not None:
                    rank.status = status_of(rank.proc.returncode)
                    rank.ended_ns = time.time_ns()
                    if rank.status != 0 and not rank.ended_by_launcher:
                        self.after_failure(rank, store_url)
            if self.only_waiting_replacements_left():
                self.end_all(signal.SIGTERM)  # (no member is left to take them in)
            time.sleep(POLL_S)

    def only_waiting_replacements_left(self) -> bool:
        """Whether every process still running is a replacement not yet taken into the
        job (it records "started" once admitted): they would wait for ever."""
        running = [r for r in self.ranks if r.status is None]
        if not running or not all(r.replacement for r in running):
            return False
        started = {r.get("pid") for r in process.read_job_records(self.status_dir)
                   if r.get("kind") == "started"}
        return not any(r.proc.pid in started for r in running)

    def after_failure(self, failed: Rank, store_url: str) -> None:
        options = self.options
        if not options.elastic:
            self.end_all(signal.SIGTERM)
            return
        if any(r.status == 0 for r in self.ranks):
            return  # the job is finishing: nothing to replace
        alive = sum(r.status is None for r in self.ranks)
        limit = options.max_np or options.np
        budget = options.reset_limit or 4 * options.np  # replacements that crash end here
        if options.respawn and alive < limit and self.replacements < budget:
            self.replacements += 1
            self.ranks.append(self.start_rank(len(self.ranks), None, store_url, failed.host))

    def signal_all(self, signum: int) -> None:
        for rank in self.ranks:
            if rank.status is None:
                try:
                    os.killpg(rank.proc.pid, signum)
                except ProcessLookupError:
                    pass

    def end_all(self, signum: int) -> None:
        """SIGTERM to every rank still running, SIGKILL after GRACE_S."""
        running = [r for r in self.ranks if r.proc.poll() is None]
        for rank in running:
            rank.ended_by_launcher = True
        self.signal_all(signum)
        deadline = time.monotonic() + GRACE_S
        while any(r.proc.poll() is None for r in running) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for rank in running:
            if rank.proc.poll() is None:
                os.killpg(rank.proc.pid, signal.SIGKILL)
            rank.proc.wait()
            if rank.status is None:
                rank.status = status_of(rank.proc.returncode)

    # ---- the outcome ----

    def in_failure_order(self, failed: list[Rank]) -> list[Rank]:
        """The first failure first (often the cause of the others), by the time each rank
        recorded it (else when the launcher saw it end), with the cause it recorded."""
        records = _failure_records(self.status_dir)
        for rank in failed:
            record = records.get(rank.proc.pid)
            if record:
                rank.ended_ns, rank.cause = record.get("time_ns") or rank.ended_ns, \
                    record.get("cause")
        return sorted(failed, key=lambda r: r.ended_ns)

    def exit_status(self) -> int:
        failed = [r for r in self.ranks if r.status != 0 and not r.ended_by_launcher]
        if not failed:
            return 0
        if self.options.elastic:
            finished = any(r.status == 0 for r in self.ranks)
            status, message = process.job_status(0 if finished else failed[0].status,
                                                 process.read_job_records(self.status_dir))
            if message:
                print(message, file=sys.stderr, flush=True)
            return status
        failed = self.in_failure_order(failed)
        ended = [r.label for r in self.ranks if r.ended_by_launcher]
        print("ringsync run: the job failed: %s%s" % (
            "; ".join(describe_end(r) for r in failed),
            "; the launcher ended rank(s) %s" % ended if ended else ""),
            file=sys.stderr, flush=True)
        return failed[0].status


def _failure_records(status_dir: str) -> dict:
    """{pid: the "failed" record} the ranks left (ringsync.bootstrap.record_job_event)."""
    return {r.get("pid"): r for r in process.read_job_records(status_dir)
            if r.get("kind") == "failed"}


def status_of(returncode: int) -> int:
    """A shell's exit status: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_end(rank: Rank) -> str:
    name = ("replacement %d" if rank.replacement else "rank %d") % rank.label
    if rank.status > 128:
        try:
            return "%s (on %s) was killed by %s" % (name, rank.host,
                                                    signal.Signals(rank.status - 128).name)
        except ValueError:
            pass
    cause = rank.cause or ""
    if len(cause) > process.CAUSE_SHOWN:
        cause = cause[:process.CAUSE_SHOWN] + "..."
    return "%s (on %s) exited with status %d%s" % (name, rank.host, rank.status,
                                                   " (%s)" % cause if cause else "")


def ssh_words(options: RunOptions, host: str) -> list[str]:
    """How to run a command on host: the agent given, else ssh (port, identity)."""
    if options.ssh_agent:
        return [options.ssh_agent, host]
    words = ["ssh", "-o", "BatchMode=yes"]
    if options.ssh_port is not None:
        words += ["-p", str(options.ssh_port)]
    if options.ssh_identity_file:
        words += ["-i", options.ssh_identity_file]
    return words + [host]


class RankFiles:
    """--output-filename DIR: each rank's lines also go to DIR/rank.<r>/stdout, stderr."""

    def __init__(self, directory: str, np: int):
        self.directory, self.width = directory, len(str(max(np - 1, 0)))
        self.files, self.lock = {}, threading.Lock()

    def write_line(self, label: int, stream: str, line: bytes) -> None:
        with self.lock:
            key = (label, stream)
            if key not in self.files:
                folder = os.path.join(self.directory, "rank.%0*d" % (self.width, label))
                os.makedirs(folder, exist_ok=True)
                self.files[key] = open(os.path.join(folder, stream), "wb")
            self.files[key].write(line)
            self.files[key].flush()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _remove_tree(path: str) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def run_direct(options: RunOptions, diagnostics=None) -> int:
    status_dir = tempfile.mkdtemp(prefix="ringsync-job-")
    try:
        return DirectJob(options, status_dir, diagnostics).run()
    finally:
        _remove_tree(status_dir)


# --------------------------------------------------------------------------- the rank's side


def main(argv: list[str] | None = None) -> None:
    """On a remote host: read the secret from stdin, then become the program."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != SECRET_OPTION or argv[1] != "--":
        sys.exit("usage: python -m ringsync.launch.direct %s -- PROGRAM [ARGS...]"
                 % SECRET_OPTION)
    secret = sys.stdin.readline().strip()
    if len(secret) < 16:
        sys.exit("ringsync.launch.direct: no job secret on stdin")
    os.environ["RINGSYNC_SECRET"] = secret
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as exc:
        print("ringsync.launch.direct: cannot run %r: %s" % (argv[2], exc.strerror),
              file=sys.stderr)
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main()
