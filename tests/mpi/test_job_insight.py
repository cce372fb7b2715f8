"""Seeing inside a job, with real processes (tests/common/insight_job.py): a slow rank is
named by the straggler report on every rank and in rank 0's log; a rank that skips a
tensor is named, with where it is, in one merged hang report (plain mpirun: rank 0 prints
it; `ringsync run`: the launcher does, also at the first Ctrl-C); a killed rank and a
mismatched collective leave flight records from which `ringsync trace` names the rank
and the collective. (Thread-rank checks of the same pieces: tests/unit/test_observe.py.)"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from ringsync.launch import cli
from ringsync.testing import run_mpi
from tests.common.jobs import run_to_deadline
from tests.mpi.test_launchers import ROOT, job_environment

JOB = os.path.join(ROOT, "tests", "common", "insight_job.py")
DEADLINE_S = 120


def results(output: str) -> dict:
    """{rank: the RESULT it printed}."""
    found = {}
    for line in output.splitlines():
        match = re.search(r"RESULT (\{.*\})", line)
        if match:
            value = json.loads(match.group(1))
            found[value["rank"]] = value
    return found


def ringsync_run(*args, env=None):
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", *args, sys.executable, JOB]
    return command, job_environment(**(env or {}))


def cli_text(capsys, *argv) -> str:
    status = cli.main(list(argv))
    text = capsys.readouterr().out
    assert status == 0, text
    return text


def check_skip_report(text: str):
    assert "allreduce 'grad.fc2.weight': submitted by 0-1, missing on 2" in text, text
    assert re.search(r"rank 2 \(host \S+\) is in evaluate\(\) at \S*insight_job\.py:\d+", text), text


def test_a_slow_rank_is_named_on_every_rank_and_in_the_log():
    result = run_mpi(JOB, np=3, args=["slow"], timeout=DEADLINE_S, check=True,
                     env={"RINGSYNC_STRAGGLER_REPORT_SECONDS": "0.3"})
    found = results(result.output)
    assert sorted(found) == [0, 1, 2], result.report()
    assert all(value["worst"] == 1 for value in found.values()), result.report()
    assert re.search(r"ringsync: rank 1 \(host \S+\) kept the others waiting \d+ ms per round",
                     result.output), result.report()


def test_a_skipped_tensor_is_named_in_one_report_under_plain_mpirun(tmp_path, capsys):
    result = run_mpi(JOB, np=3, args=["skip"], timeout=DEADLINE_S, check=True,
                     env={"RINGSYNC_STALL_CHECK_SECONDS": "1",
                          "RINGSYNC_HANG_REPORT_DIR": str(tmp_path)})
    assert result.output.count("ringsync hang report 1 (stall): 3 of 3 ranks answered") == 1, \
        result.report()
    check_skip_report(result.output)
    check_skip_report(cli_text(capsys, "report", str(tmp_path)))


def test_a_skipped_tensor_is_named_in_one_report_under_ringsync_run(tmp_path):
    command, env = ringsync_run("--launcher", "local", "-np", "3",
                                env={"RINGSYNC_STALL_CHECK_SECONDS": "1"})
    status, output = run_to_deadline(command + ["skip"], env, DEADLINE_S, cwd=ROOT)
    assert status == 0, output
    assert output.count("ringsync hang report 1 (stall)") == 1, output
    check_skip_report(output)


def signal_hung_job(signum, env_extra):
    """(exit status, output) of `ringsync run ... hang` sent signum once every rank has
    made its first step (rank 2 is then in evaluate(), the others wait for it)."""
    command, env = ringsync_run("--launcher", "local", "-np", "3", env=env_extra)
    job = subprocess.Popen(command + ["hang"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, stepped = [], threading.Event()

    def read():
        for line in job.stdout:
            lines.append(line)
            if sum("STEPPED" in seen for seen in lines) == 3:
                stepped.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert stepped.wait(DEADLINE_S), "".join(lines)
        time.sleep(0.5)  # (ranks 0 and 1 are in their allreduce by now, or soon are)
        job.send_signal(signum)
        status = job.wait(DEADLINE_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    reader.join(5)
    return status, "".join(lines)


def test_the_first_ctrl_c_prints_a_hang_report_then_ends_the_job():
    status, output = signal_hung_job(signal.SIGINT, {"RINGSYNC_STALL_CHECK_SECONDS": "0"})
    assert status != 0, output
    assert "ringsync hang report 1 (request)" in output, output
    assert re.search(r"rank 2 \(host \S+\) is in evaluate\(\)", output), output


def test_sigterm_leaves_flight_records_that_name_the_missing_rank(tmp_path, capsys):
    status, output = signal_hung_job(signal.SIGTERM, {
        "RINGSYNC_STALL_CHECK_SECONDS": "0", "RINGSYNC_FLIGHT_RECORDER_DIR": str(tmp_path)})
    assert status != 0, output
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json", "rank-1.json", "rank-2.json"], output
    text = cli_text(capsys, "trace", str(tmp_path))
    assert text.startswith("rank 2 did not issue allreduce 'grad.fc2.weight' (ranks 0, 1 did)"), \
        text
    assert text.count("terminated by SIGTERM") == 3, text


def test_a_killed_rank_is_named_from_the_flight_records(tmp_path, capsys):
    command, env = ringsync_run("--launcher", "local", "-np", "3",
                                env={"RINGSYNC_FLIGHT_RECORDER_DIR": str(tmp_path)})
    status, output = run_to_deadline(command + ["kill"], env, DEADLINE_S, cwd=ROOT)
    assert status != 0, output
    sentence = ("rank 1 left no flight record; ranks 0, 2 failed in allreduce "
                "'grad.fc1.weight' (CommunicationError")
    assert sentence in output, output  # (the launcher says it after the failure)
    assert sentence in cli_text(capsys, "trace", str(tmp_path))


def test_a_mismatched_collective_is_named_from_the_flight_records(tmp_path, capsys):
    result = run_mpi(JOB, np=3, args=["mismatch"], timeout=DEADLINE_S, check=True,
                     env={"RINGSYNC_FLIGHT_RECORDER_DIR": str(tmp_path)})
    assert all(value["error"] for value in results(result.output).values()), result.report()
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json", "rank-1.json", "rank-2.json"]
    text = cli_text(capsys, "trace", str(tmp_path))
    assert text.startswith("rank 1 issued allreduce 'x' with shape [5] where ranks 0, 2 "
                           "issued shape [4]"), text
