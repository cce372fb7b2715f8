"""ringsync.launch.process: signals passed on to a stand-in for mpirun, its death
signal, per-rank output files, and the job's exit status from the ranks' records."""

import os
import signal
import sys
import threading
import time

import pytest

from ringsync.launch import process


# Stands in for mpirun: exits with the number of the signal it gets, once it has said
# (by creating the file named by its argument) that its handlers are in place.
REPORTS_ITS_SIGNAL = (
    "import pathlib, signal, sys, time\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1):\n"
    "    signal.signal(s, lambda n, f: sys.exit(n))\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "time.sleep(30)\n"
)


@pytest.mark.parametrize("sent, received", [
    (signal.SIGINT, signal.SIGINT),
    (signal.SIGQUIT, signal.SIGTERM),  # mpirun would die of SIGQUIT and leave its ranks
    (signal.SIGUSR1, signal.SIGUSR1),
], ids=["SIGINT", "SIGQUIT", "SIGUSR1"])
def test_signals_reach_mpirun_as_signals_it_handles(tmp_path, sent, received):
    ready = tmp_path / "ready"

    def signal_launcher_once_child_is_ready():
        give_up = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < give_up:
            time.sleep(0.01)
        os.kill(os.getpid(), sent)  # this process plays the launcher

    # A no-op outside run_forwarding_signals: a late signal must not end pytest.
    previous = signal.signal(sent, lambda *_: None)
    sender = threading.Thread(target=signal_launcher_once_child_is_ready)
    sender.start()
    try:
        status = process.run_forwarding_signals(
            [sys.executable, "-c", REPORTS_ITS_SIGNAL, str(ready)])
    finally:
        sender.join(timeout=60)
        signal.signal(sent, previous)
    assert status == received


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_mpirun_gets_sigterm_when_the_launcher_dies():
    # PR_GET_PDEATHSIG (2): the signal the kernel will send when the launcher dies.
    code = ("import ctypes, sys; death = ctypes.c_int(); "
            "ctypes.CDLL(None).prctl(2, ctypes.byref(death)); sys.exit(death.value)")
    assert process.run_forwarding_signals([sys.executable, "-c", code]) == signal.SIGTERM


def test_output_files_split_the_tagged_lines_by_rank(tmp_path):
    import io
    files = process.OutputFiles(str(tmp_path / "out"), np=12)
    console = io.BytesIO()
    mpirun_output = (b"[1,0]<stdout>: zero\n[1,11]<stdout>: eleven\nmpirun says\n"
                     b"[Tue Dec  1 16:01:53 2026][1,0]<stdout>: stamped\n")
    files.pump(io.BytesIO(mpirun_output), console)
    files.close()
    assert console.getvalue() == mpirun_output  # the console sees everything
    assert (tmp_path / "out/rank.00/stdout").read_bytes() == b"zero\nstamped\n"
    assert (tmp_path / "out/rank.11/stdout").read_bytes() == b"eleven\n"


# --------------------------------------------------------------------------- the job's status


def record(kind, rank, at, cause=None, pid=None, spawned=False):
    """A record as ringsync.bootstrap.record_job_event writes it (time in ns)."""
    return {"kind": kind, "pid": pid or 1000 + rank, "host": "h", "rank": rank,
            "spawned": spawned, "time_ns": at, "code": 1 if kind == "failed" else None,
            "cause": cause}


def test_without_records_mpiruns_status_stands_alone():
    assert process.job_status(0, []) == (0, None)
    assert process.job_status(3, []) == (3, None)  # not a ringsync program


def test_failed_ranks_fail_a_job_mpirun_called_a_success_naming_the_first_failure_first():
    records = [record("started", r, 1) for r in (0, 1)]
    records += [record("failed", 1, 5, "RuntimeError: boom"),
                record("failed", 0, 7, "CommunicationError: rank 1 lost")]
    status, message = process.job_status(0, records)
    assert status == 1
    assert message.startswith("ringsync run: the job failed: rank 1 failed (RuntimeError: "
                              "boom); rank 0 failed (CommunicationError: rank 1 lost)"), message


def test_a_rank_finishing_after_the_failures_is_a_finished_job():
    records = [record("started", r, 1) for r in (0, 1, 2)]
    records += [record("failed", 2, 5, "RuntimeError: boom"), record("finished", 0, 9),
                record("finished", 1, 9)]
    assert process.job_status(0, records) == (0, None)
    # A rank that finished before the failure did not see the job through.
    records[-2:] = [record("finished", 0, 4)]
    assert process.job_status(0, records)[0] == 1


def test_ranks_that_left_no_end_were_killed():
    records = [record("started", r, 1) for r in (0, 1)]
    status, message = process.job_status(0, records)
    assert status == 1
    assert "rank 0 ended without a record" in message and "rank 1 ended without a record" in message
    # ... unless another rank finished after them (elastic survivors of a SIGKILL)
    assert process.job_status(0, records + [record("finished", 0, 9)]) == (0, None)


def test_a_rank_leaving_a_resized_job_is_no_failure():
    records = [record("started", 0, 1), record("left", 0, 3), record("started", 1, 1),
               record("finished", 1, 5)]
    assert process.job_status(0, records) == (0, None)


def test_a_start_after_an_end_counts_from_the_start():
    records = [record("started", 0, 1), record("finished", 0, 2), record("started", 0, 3)]
    assert "rank 0 ended without a record" in process.job_status(0, records)[1]


def test_mpiruns_failure_wins_and_the_failed_ranks_are_named():
    records = [record("started", 0, 1), record("failed", 0, 2, "ValueError: x" * 50),
               record("started", 0, 1, pid=77, spawned=True)]
    status, message = process.job_status(137, records)
    assert status == 137
    assert message.startswith("ringsync run: the job failed (exit status 137): rank 0 failed "
                              "(ValueError: x"), message
    assert "...); a replacement rank (pid 77) ended without a record" in message
    assert process.job_status(3, [record("started", 0, 1), record("finished", 0, 2)]) == \
        (3, "ringsync run: the job failed (exit status 3)")


def test_ranks_record_how_they_end_where_the_launcher_reads_it(tmp_path):
    from ringsync import bootstrap
    env = {bootstrap.JOB_STATUS_DIR_ENV: str(tmp_path), "OMPI_COMM_WORLD_RANK": "3"}
    bootstrap.record_job_event("started", environ=env)
    bootstrap.record_job_event("failed", code=1, cause="E" * 1000, environ=env)
    (tmp_path / ".half-written.json").write_text("{")
    records = process.read_job_records(str(tmp_path))
    assert [(r["kind"], r["rank"], r["pid"]) for r in records] == \
        [("failed", 3, os.getpid()), ("started", 3, os.getpid())]
    assert len(records[0]["cause"]) == bootstrap.CAUSE_LIMIT
    bootstrap.record_job_event("finished", environ={bootstrap.JOB_STATUS_DIR_ENV:
                                                    str(tmp_path / "not-on-this-host")})
    assert not (tmp_path / "not-on-this-host").exists()
