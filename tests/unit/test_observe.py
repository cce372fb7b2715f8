"""Seeing inside a job with ranks as threads: straggler events from the negotiation
rounds, the flight recorder (in memory, on a failure, bounded), hang reports agreed on
every rank (a stall, a request, a blocking call on the same-host lane) and the timeline's
counter track. (With processes and launchers: tests/mpi/test_job_insight.py.)"""
import glob
import json
import os
import time

import numpy as np
import pytest

from ringsync import MismatchError
from ringsync.diagnose import describe_divergence, load_flight_records, load_hang_parts
from tests.thread_ranks import assert_ok, assert_ranks_ok

NAMES = ["grad.a", "grad.b", "grad.c"]


def steps(comm, count, slow_rank=None, sleep_s=0.03):
    for step in range(count):
        if comm.rank() == slow_rank:
            time.sleep(sleep_s)
        handles = [comm.allreduce_async(np.arange(32, dtype=np.float32) * (comm.rank() + 1) + i,
                                        name=name) for i, name in enumerate(NAMES)]
        for handle in handles:
            comm.synchronize(handle)


@pytest.mark.parametrize("size,slow", [(3, 1), (4, 3)])
def test_the_rank_everyone_waits_for_is_named_on_every_rank(size, slow):
    def body(comm):
        steps(comm, 8, slow_rank=slow)
        return comm.straggler_report(last=8)
    reports = assert_ranks_ok(body, size, timeout=60)
    for rank, report in enumerate(reports):
        assert [row["rank"] for row in report] == list(range(size)), report
        worst = max(report, key=lambda row: row["mean_ms"])
        assert worst["rank"] == slow, (rank, report)
        assert worst["rounds_last"] >= 6 and worst["rounds"] == 8, (rank, report)
        assert worst["p95_ms"] >= worst["p50_ms"] > 0, (rank, report)
        others = [row for row in report if row["rank"] != slow]
        assert all(row["rounds_last"] <= 1 for row in others), (rank, report)


def test_a_log_line_names_the_straggler(capsys):
    env = {"RINGSYNC_STRAGGLER_REPORT_SECONDS": "0.2", "RINGSYNC_STRAGGLER_THRESHOLD_MS": "1"}

    def body(comm):
        steps(comm, 12, slow_rank=2)
        time.sleep(0.5)  # (rank 0's look comes meanwhile)
    assert_ranks_ok(body, 3, env=env, timeout=60)
    err = capsys.readouterr().err
    assert "ringsync: rank 2 (host " in err and "kept the others waiting" in err, err


def test_no_records_kept_means_no_events_and_no_records():
    def body(comm):
        steps(comm, 3, slow_rank=1)
        return comm.straggler_report(last=3), comm.flight_records()
    for report, records in assert_ranks_ok(body, 2, env={"RINGSYNC_FLIGHT_RECORDER_SIZE": "0"}):
        assert records == [] and all(row["rounds_last"] == 0 for row in report), report


def test_straggler_report_refuses_a_bad_window():
    def body(comm):
        with pytest.raises(ValueError, match="last must be at least 1"):
            comm.straggler_report(last=0)
    assert_ranks_ok(body, 2)


def test_flight_records_say_what_each_rank_issued_and_how_it_ended():
    def body(comm):
        steps(comm, 1)
        comm.allgather(np.ones((comm.rank() + 1, 2), np.int32), name="rows")
        comm.broadcast(np.zeros(3, np.float64), root_rank=1, name="weights")
        return comm.flight_records()
    for rank, records in enumerate(assert_ranks_ok(body, 3)):
        by_name = {r["name"]: r for r in records}
        assert set(NAMES) | {"rows", "weights"} <= set(by_name), records
        assert by_name["grad.a"]["kind"] == "allreduce" and by_name["grad.a"]["op"] == "average"
        assert by_name["grad.a"]["dtype"] == "float32" and by_name["grad.a"]["shape"] == [32]
        assert by_name["rows"]["shape"] == [rank + 1, 2] and by_name["rows"]["dtype"] == "int32"
        assert by_name["weights"]["root"] == 1 and by_name["weights"]["dtype"] == "float64"
        assert all(r["result"] == "ok" and r["end"] >= r["start"] for r in records), records
        assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)


def test_the_recorder_keeps_only_the_latest():
    def body(comm):
        for i in range(40):
            comm.allreduce(np.ones(2, np.float32), name=f"t{i}")
        return comm.flight_records()
    for records in assert_ranks_ok(body, 2, env={"RINGSYNC_FLIGHT_RECORDER_SIZE": "16"}):
        assert [r["name"] for r in records] == [f"t{i}" for i in range(24, 40)], records


@pytest.mark.parametrize("route", ["lane", "engine"])
def test_a_mismatch_leaves_records_that_name_the_odd_rank(tmp_path, route):
    env = {"RINGSYNC_FLIGHT_RECORDER_DIR": str(tmp_path),
           "RINGSYNC_LANE_BYTES": "0" if route == "engine" else "65536"}

    def body(comm):
        steps(comm, 1)
        with pytest.raises(MismatchError, match="shapes for 'x'"):
            comm.allreduce(np.ones(5 if comm.rank() == 2 else 4, np.float32), name="x")
        comm.allreduce(np.ones(4, np.float32), name="after")  # the next call works
    assert_ranks_ok(body, 3, env=env)
    files = load_flight_records(str(tmp_path))
    assert sorted(files) == [0, 1, 2]
    assert [r["route"] for r in files[0]["records"] if r["name"] == "x"] == [route]
    text = describe_divergence(files)
    assert text.startswith("rank 2 issued allreduce 'x' with shape [5] where ranks 0, 1 "
                           "issued shape [4]"), text


def wait_for_part(directory, rank, deadline_s=30):
    deadline = time.monotonic() + deadline_s
    while not glob.glob(os.path.join(directory, f"hang-*-rank-{rank}.json")):
        assert time.monotonic() < deadline, f"no hang report part of rank {rank}"
        time.sleep(0.02)


@pytest.mark.parametrize("blocking", [False, True], ids=["async", "lane"])
def test_a_stall_brings_one_report_from_every_rank(tmp_path, blocking):
    env = {"RINGSYNC_STALL_CHECK_SECONDS": "0.3", "RINGSYNC_HANG_REPORT_DIR": str(tmp_path)}

    def body(comm):
        steps(comm, 1)
        if comm.rank() == 1:
            wait_for_part(str(tmp_path), 1)  # (its detour: back once the report is in)
        x = np.full(4, comm.rank() + 1.0, np.float32)
        if blocking:
            return comm.allreduce(x, name="late", op=0).tolist()
        return comm.synchronize(comm.allreduce_async(x, name="late", op=0)).tolist()
    totals = assert_ranks_ok(body, 3, env=env, timeout=60)
    assert totals == [[6.0] * 4] * 3
    report, parts = load_hang_parts(str(tmp_path))
    assert report == 1 and sorted(parts) == [0, 1, 2]
    for rank, part in parts.items():
        assert part["reason"] == "stall" and part["size"] == 3
        late = [p for p in part["pending"] if p["name"] == "late"]
        if blocking and rank == 1:
            assert late == [], part["pending"]  # (rank 1 is not in the lane call yet)
            continue
        assert len(late) == 1 and late[0]["missing"] == [1], (rank, part["pending"])
        assert late[0]["submitted"] == [0, 2] and late[0]["mine"] == (rank != 1)
        finished = [r["name"] for r in part["recent"] if r["result"] == "ok"]
        assert set(finished[-3:]) == set(NAMES), part["recent"]
        if rank != 1:  # (its request is in the record, not yet run)
            assert part["recent"][-1]["name"] == "late", part["recent"]
            assert part["recent"][-1]["result"] == "running", part["recent"]


def test_a_request_from_one_rank_brings_a_report_from_every_rank(tmp_path):
    env = {"RINGSYNC_HANG_REPORT_DIR": str(tmp_path), "RINGSYNC_STALL_CHECK_SECONDS": "0"}

    def body(comm):
        steps(comm, 1)
        if comm.rank() == 2:
            comm.request_hang_report()
        for rank in range(3):
            wait_for_part(str(tmp_path), rank)
    assert_ranks_ok(body, 3, env=env, timeout=60)
    report, parts = load_hang_parts(str(tmp_path))
    assert report == 1 and sorted(parts) == [0, 1, 2]
    assert all(p["reason"] == "request" and p["pending"] == [] for p in parts.values())
    assert all(any(t["waits_in_ringsync"] or t["stack"] for t in p["threads"])
               for p in parts.values())


def test_the_timeline_has_a_counter_of_who_kept_the_others_waiting(tmp_path):
    path = tmp_path / "trace.json"

    def body(comm):
        comm.start_timeline(str(path))
        steps(comm, 4, slow_rank=1)
        comm.stop_timeline()
    assert_ranks_ok(body, 2, env={"RINGSYNC_TRANSPORT": "tcp"})
    events = json.loads(path.read_text())["traceEvents"]
    counters = [e for e in events if e.get("ph") == "C"]
    assert counters and all(set(e["args"]) == {"rank 1"} for e in counters), counters


def test_straggler_statistics_are_numpys_over_the_whole_window():
    from ringsync._observe import _sparse_stats
    rng = np.random.default_rng(7)
    for window in (1, 2, 5, 200):
        for count in {0, 1, window // 2, window}:
            caused = list(rng.uniform(0.1, 50.0, count))
            vector = np.array([0.0] * (window - count) + caused)
            expected = (vector.mean(), np.percentile(vector, 50), np.percentile(vector, 95))
            assert np.allclose(_sparse_stats(caused, window), expected), (window, count)


def test_a_report_wait_that_begins_after_the_interrupt_does_not_wait():
    """The observer thread may not have begun to wait when the ring stops it (a ring shut
    down right after init, on a loaded host): its wait must end at once then too, or
    shutdown() joins it for ever (seen as a hung rank in the suite)."""
    import threading

    from ringsync._native import ffi, lib

    def body(comm):
        engine = comm._ring.engine
        lib.rs_engine_interrupt_waits(engine)
        result = []
        waiter = threading.Thread(target=lambda: result.append(
            lib.rs_engine_wait_report(engine, 0, 3600.0, ffi.new("int *"))))
        waiter.start()
        waiter.join(30)  # (a deadline: the wait is for an hour when it is wrong)
        assert not waiter.is_alive() and result == [0], "the wait did not end"
    assert_ranks_ok(body, 2, timeout=60)


def test_hang_reports_leave_a_c_handler_of_sigusr1_alone():
    """faulthandler's stack dumps on SIGUSR1 (the test harness's, or a user's) are a C
    handler that signal.getsignal cannot see: init() must not take the signal over."""
    import faulthandler
    import signal
    import subprocess
    import sys
    code = ("import faulthandler, signal, sys\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
            "from ringsync import _observe\n"
            "_observe.install_report_signal(lambda: None)\n"
            "print(signal.getsignal(signal.SIGUSR1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "lambda" not in out.stdout, out
    code = code.replace("faulthandler.register(signal.SIGUSR1, all_threads=True)\n", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "lambda" in out.stdout, out


def test_two_threads_writing_one_file_atomically_leave_one_whole_file(tmp_path):
    """A failure's flight records and SIGTERM's are written by two threads of one process
    to one path: each thread writes its own temporary file (they once shared one, so a
    rename found it gone, or the process ended with it half-written), and the path ends
    holding one writer's whole data, with no temporary file left."""
    import threading

    from ringsync._atomic import write_atomically

    path = str(tmp_path / "rank-0.json")
    payloads = [bytes([65 + k]) * 200_000 for k in range(2)]
    errors, start = [], threading.Barrier(2)

    def writer(data):
        try:
            start.wait()
            for _ in range(100):
                write_atomically(path, data)
        except BaseException as exc:  # (reported below)
            errors.append(exc)
    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json"]
    with open(path, "rb") as f:
        assert f.read() in payloads
