"""Signals to ``ringsync run`` itself: whatever ends the launcher, SIGKILL included, ends
mpirun and every rank; Ctrl-Z (SIGTSTP) suspends the whole job and SIGCONT resumes it.

Each test starts ``ringsync run -np 2`` on a script that records its pid and then keeps
bumping a heartbeat file, signals the launcher, and polls /proc until the expected state
is reached or a deadline passes. Whatever a test started is SIGKILLed in a ``finally``,
so a failing test leaves nothing running.
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from ringsync.launch import cli

pytestmark = [
    pytest.mark.requires_mpirun,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; needs prctl"),
]

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(cli.__file__))))  # ringsync/launch/cli.py: three levels down
START_DEADLINE = 90  # mpirun start-up on a busy 2-core machine
DEADLINE = 20

RANK_SCRIPT = """\
import os, sys, time
directory = sys.argv[1]
rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK", "0")

def write(name, text):  # atomically, so a reader never sees a half-written file
    with open(os.path.join(directory, name + ".tmp"), "w") as f:
        f.write(text)
    os.replace(os.path.join(directory, name + ".tmp"), os.path.join(directory, name))

write("rank-%s.pid" % rank, str(os.getpid()))
beat = 0
while True:
    beat += 1
    write("rank-%s.beat" % rank, str(beat))
    time.sleep(0.05)
"""


# --------------------------------------------------------------------------- /proc


def stat_fields(pid):
    """Fields of /proc/PID/stat after the command name (state first), or None if no such pid."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()


class Proc:
    """A process we may have to check on or kill later; the start time tells it apart from
    a later process that got the same pid."""

    def __init__(self, pid, name):
        self.pid, self.name = pid, name
        fields = stat_fields(pid)
        self.start_time = fields[19] if fields else None

    def state(self):
        """One-letter /proc state (R, S, T, Z...), or None once the process is gone."""
        fields = stat_fields(self.pid)
        if fields is None or fields[19] != self.start_time:
            return None
        return fields[0]

    def running(self):
        """Alive and not a zombie (an unreaped dead process)."""
        return self.state() not in (None, "Z", "X")

    def kill(self):
        if self.running():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __repr__(self):
        return "%s %d (%s)" % (self.name, self.pid, self.state() or "gone")


def children_of(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields and int(fields[1]) == pid:
                found.append(int(entry))
    return found


def pids_with_marker(marker):
    """Pids whose command line contains ``marker`` (unique to one test's job)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def wait_for(condition, deadline, what, job):
    """Poll ``condition()`` until it is true; fail, naming ``what``, after ``deadline`` s."""
    give_up = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > give_up:
            pytest.fail("%s: not within %d s; processes: %s\n%s"
                        % (what, deadline, job.processes, job.output()))
        time.sleep(0.05)


# --------------------------------------------------------------------------- the job


class Job:
    """``ringsync run -np 2`` on RANK_SCRIPT, in a session of its own so that neither the
    signals sent nor the stops reach pytest."""

    def __init__(self, tmp_path):
        self.directory = tmp_path
        self.marker = "ringsync-signal-test-" + uuid.uuid4().hex
        script = tmp_path / "rank_loop.py"
        script.write_text(RANK_SCRIPT)
        self.log = open(tmp_path / "launcher.log", "w")
        env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, PYTHONUNBUFFERED="1")
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "ringsync.launch.cli", "run", "-np", "2",
             str(script), str(tmp_path), self.marker],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.launcher_process = Proc(self.launcher.pid, "launcher")
        self.processes = [self.launcher_process]
        self.ranks = []
        self.mpirun = None

    def output(self):
        self.log.flush()
        return "launcher output:\n" + (self.directory / "launcher.log").read_text()

    def wait_until_ranks_run(self):
        def both_ranks_wrote_pids():
            assert self.launcher.poll() is None, "launcher ended early\n" + self.output()
            return all((self.directory / ("rank-%d.pid" % r)).exists() for r in (0, 1))

        wait_for(both_ranks_wrote_pids, START_DEADLINE, "both ranks start", self)
        self.ranks = [Proc(int((self.directory / ("rank-%d.pid" % r)).read_text()), "rank %d" % r)
                      for r in (0, 1)]
        self.processes += self.ranks
        mpiruns = children_of(self.launcher.pid)
        assert len(mpiruns) == 1, "launcher children: %s" % mpiruns
        self.mpirun = Proc(mpiruns[0], "mpirun")
        self.processes.append(self.mpirun)
        assert all(p.running() for p in self.processes), self.processes

    def beats(self):
        return [int((self.directory / ("rank-%d.beat" % r)).read_text()) for r in (0, 1)]

    def signal_launcher(self, signum):
        os.kill(self.launcher.pid, signum)

    def all_gone(self):
        self.launcher.poll()  # reap it: our own dead child would stay a zombie
        return not any(p.running() for p in self.processes)

    def clean_up(self):
        """SIGKILL whatever of the job still runs (stopped processes die of SIGKILL too)."""
        for proc in self.processes:
            proc.kill()
        for pid in pids_with_marker(self.marker):
            Proc(pid, "leftover").kill()
        try:
            self.launcher.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


@pytest.fixture
def job(tmp_path):
    started = Job(tmp_path)
    try:
        yield started
    finally:
        started.clean_up()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("signum", [signal.SIGQUIT, signal.SIGKILL], ids=["SIGQUIT", "SIGKILL"])
def test_ending_the_launcher_ends_mpirun_and_every_rank(job, signum):
    job.wait_until_ranks_run()
    job.signal_launcher(signum)
    wait_for(job.all_gone, DEADLINE, "launcher, mpirun and both ranks gone", job)
    assert not pids_with_marker(job.marker)


def test_ctrl_z_stops_the_whole_job_and_sigcont_resumes_it(job):
    job.wait_until_ranks_run()
    job.signal_launcher(signal.SIGTSTP)
    stopped = [job.launcher_process] + job.ranks  # mpirun keeps running, to relay SIGCONT
    wait_for(lambda: all(p.state() == "T" for p in stopped), DEADLINE,
             "launcher and both ranks stopped", job)
    assert job.mpirun.running(), job.processes

    beats_while_stopped = job.beats()
    job.signal_launcher(signal.SIGCONT)
    wait_for(lambda: all(now > then for now, then in zip(job.beats(), beats_while_stopped)),
             DEADLINE, "both ranks beating again", job)
    assert job.launcher_process.state() != "T", job.processes

    job.signal_launcher(signal.SIGTERM)
    wait_for(job.all_gone, DEADLINE, "job gone after SIGTERM", job)


def test_killing_a_stopped_launcher_ends_the_stopped_job(job):
    job.wait_until_ranks_run()
    job.signal_launcher(signal.SIGTSTP)
    wait_for(lambda: all(p.state() == "T" for p in job.ranks), DEADLINE, "both ranks stopped", job)
    job.signal_launcher(signal.SIGKILL)
    wait_for(job.all_gone, DEADLINE, "launcher, mpirun and both ranks gone", job)
    assert not pids_with_marker(job.marker)
