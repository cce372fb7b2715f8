"""ringsync.diagnose and `ringsync trace` / `ringsync report`: flight records and hang report
parts written by hand into tmp_path, read back into one sentence and one merged report.

The files are built the way a job leaves them: names repeat every step, ranks submit in
different orders and keep windows of different lengths, so an answer found by lining files
up by position would name the wrong rank or tensor and fail these checks.
"""

import ast
import json
import sys
from pathlib import Path

import pytest

from ringsync.diagnose import (describe_divergence, format_hang_report, load_flight_records,
                               load_hang_parts)
from ringsync.diagnose.trace import rank_list
from ringsync.launch import cli

STEP = 10.0  # seconds between training steps in the made-up records
LOST_WHY = ("CommunicationError: ringsync.allreduce('grad.w') failed on rank {rank}: the "
            "connection to rank 1 (hostB) was reset by its peer while 80 bytes were in flight; "
            "the communicator is broken: rebuild it or end the job")


# ---------------------------------------------------------------- flight record files

def record(name, start, kind="allreduce", result="ok", shape=(4,), dtype="float32", seq=0):
    return {"seq": seq, "set": 0, "name": name, "kind": kind,
            "op": "sum" if kind == "allreduce" else None, "dtype": dtype,
            "shape": list(shape), "bytes": 4, "route": "engine", "start": start,
            "end": None if result == "running" else start + 0.01, "result": result}


def steps(names, count, first_step=0):
    """`count` steps of ok records of `names`, in that order, oldest first."""
    return [record(name, (first_step + step) * STEP + i * 0.1)
            for step in range(count) for i, name in enumerate(names)]


def write_flight(directory, rank, records, size, why="CommunicationError: failed",
                 host=None, written_at=None):
    part = {"format": "ringsync-flight-recorder", "version": 1, "rank": rank, "size": size,
            "host": host or "host%d" % rank, "pid": 100 + rank,
            "written_at": written_at or max(r["start"] for r in records) + 1.0, "why": why,
            "records": [dict(r, seq=i) for i, r in enumerate(records)]}
    (directory / ("rank-%d.json" % rank)).write_text(json.dumps(part))


def first_line(text):
    return text.splitlines()[0]


def table_rows(text):
    """{rank: the table's row, split into its cells} (cells are two spaces apart)."""
    rows = [line.split("  ") for line in text.split("\n\n", 1)[1].splitlines()[1:]]
    return {int(row[0]): [cell.strip() for cell in row if cell.strip()] for row in rows}


def test_a_killed_rank_is_named_where_the_survivors_lost_it(tmp_path):
    # Rank 1 was killed during step 5's allreduce 'grad.w'; it wrote nothing.
    for rank in (0, 2, 3):
        failed = record("grad.w", 50.1 + rank / 100, result="CommunicationError")
        records = steps(["grad.b", "grad.w"], 5) + [record("grad.b", 50.0), failed]
        write_flight(tmp_path, rank, records, size=4, why=LOST_WHY.format(rank=rank))
    text = describe_divergence(load_flight_records(tmp_path))
    why = LOST_WHY.format(rank=0)[:120]
    assert first_line(text) == (
        "rank 1 left no flight record; ranks 0, 2, 3 failed in allreduce 'grad.w' "
        "(%s...): rank 1 was lost there." % why)
    rows = table_rows(text)
    assert rows[1] == ["1", "-", "-", "-", "-", "(no flight record)"]
    assert rows[2][:5] == ["2", "host2", "12", "allreduce 'grad.b'",
                           "allreduce 'grad.w' (CommunicationError)"]


def mismatch_files(directory, odd_rank, size, **odd_call):
    """Every rank of `size` ran 3 good steps of 'x' and 'y'; at step 4 `odd_rank` issued
    'x' with `odd_call` changed and every rank's 'x' failed with MismatchError."""
    for rank in range(size):
        call = odd_call if rank == odd_rank else {}
        records = steps(["x", "y"], 3) + [
            record("x", 30.0 + rank / 100, result="MismatchError", **call)]
        write_flight(directory, rank, records, size,
                     why="MismatchError: ringsync.allreduce('x'): ranks disagree")


def test_a_mismatched_call_names_the_odd_rank_against_the_majority(tmp_path):
    mismatch_files(tmp_path, odd_rank=1, size=3, shape=(5,))
    text = describe_divergence(load_flight_records(tmp_path))
    assert first_line(text) == (
        "rank 1 issued allreduce 'x' with shape [5] where ranks 0, 2 issued shape [4].")


def test_two_ranks_that_disagree_are_both_named(tmp_path):
    mismatch_files(tmp_path, odd_rank=1, size=2, dtype="float64")
    text = describe_divergence(load_flight_records(tmp_path))
    assert first_line(text) == (
        "rank 0 issued allreduce 'x' with dtype float32 and rank 1 issued dtype float64.")


def test_a_different_kind_of_call_shows_in_the_label(tmp_path):
    mismatch_files(tmp_path, odd_rank=2, size=3, kind="allgather")
    text = describe_divergence(load_flight_records(tmp_path))
    assert first_line(text) == (
        "rank 2 issued allgather 'x' with op none where ranks 0, 1 issued allreduce 'x' "
        "with op sum.")


def test_a_rank_that_skipped_a_tensor_is_named_with_where_it_went(tmp_path):
    # Step 4: rank 2 skipped 'grad.b' and went on to allgather 'metrics' a moment before
    # ranks 0 and 1 entered 'grad.b'; everybody waits, nobody failed yet (a signal).
    names = ["grad.a", "grad.b", "metrics"]
    for rank in (0, 1):
        records = steps(names, 4) + [record("grad.a", 40.0),
                                     record("grad.b", 40.3, result="running")]
        write_flight(tmp_path, rank, records, size=3, why="SIGTERM")
    records = steps(names, 4) + [record("grad.a", 40.0),
                                 record("metrics", 40.2, kind="allgather", result="running")]
    write_flight(tmp_path, 2, records, size=3, why="SIGTERM", written_at=60.0)
    text = describe_divergence(load_flight_records(tmp_path))
    assert first_line(text) == (
        "rank 2 did not issue allreduce 'grad.b' (ranks 0, 1 did); its last collective was "
        "allgather 'metrics' (running).")


def test_windows_of_different_lengths_in_different_orders_are_matched_by_name(tmp_path):
    # Each rank kept a different number of records and submits the step's tensors in its
    # own order; at step 6 rank 2 gave 'grad.c' as float16.
    names = ["grad.a", "grad.b", "grad.c"]
    kept = {0: 12, 1: 4, 2: 7}
    for rank, count in kept.items():
        order = names if rank != 1 else names[::-1]
        records = steps(order, 6)[-(count - 1):] + [record(
            "grad.c", 60.0, result="MismatchError", dtype="float16" if rank == 2 else "float32")]
        write_flight(tmp_path, rank, records, size=3)
    text = describe_divergence(load_flight_records(tmp_path))
    assert first_line(text) == (
        "rank 2 issued allreduce 'grad.c' with dtype float16 where ranks 0, 1 issued "
        "dtype float32.")
    assert {rank: int(row[2]) for rank, row in table_rows(text).items()} == kept


def test_a_window_that_begins_after_the_failure_accuses_nobody(tmp_path):
    # Ranks 0 and 1 timed out in 'x' at t=100; rank 2's kept records all start later, so
    # they cannot say whether it issued 'x'.
    for rank in (0, 1):
        write_flight(tmp_path, rank, steps(["x"], 10) + [
            record("x", 100.0, result="CommunicationTimeout")], size=3,
            why="CommunicationTimeout: no progress in 30 s")
    write_flight(tmp_path, 2, steps(["y"], 3, first_step=11), size=3, why="SIGTERM")
    text = describe_divergence(load_flight_records(tmp_path))
    assert first_line(text) == (
        "ranks 0, 1 failed in allreduce 'x' (CommunicationTimeout: no progress in 30 s).")


def test_foreign_and_broken_files_are_skipped_and_named(tmp_path):
    write_flight(tmp_path, 0, steps(["x"], 2), size=2)
    (tmp_path / "rank-1.json").write_bytes(b"\x00\xffnot json")
    (tmp_path / "rank-2.json").write_text(json.dumps({"format": "something-else", "rank": 2}))
    newer = json.loads((tmp_path / "rank-0.json").read_text())
    (tmp_path / "rank-3.json").write_text(json.dumps(dict(newer, rank=3, size=4, version=2)))
    (tmp_path / "rank-4.json").write_text(
        (tmp_path / "rank-0.json").read_text().replace('"start": 0.0', '"start": NaN')
        .replace('"rank": 0', '"rank": 4').replace('"size": 2', '"size": 5'))
    (tmp_path / "notes.txt").write_text("not ours, not mentioned")
    with pytest.warns(UserWarning) as warned:
        files = load_flight_records(tmp_path)
    assert sorted(files) == [0]
    notes = sorted(str(w.message) for w in warned)
    assert [Path(note.split(": ")[0].split()[-1]).name for note in notes] == [
        "rank-1.json", "rank-2.json", "rank-3.json", "rank-4.json"]
    assert "version 2" in notes[2]
    # the size rank 0 wrote still counts rank 1 as silent
    assert "rank 1 left no flight record (killed, or it never saw a failure)" in first_line(
        describe_divergence(files))


def test_a_directory_without_flight_records_is_refused_by_name(tmp_path):
    (tmp_path / "hang-1-rank-0.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no flight records .* in %s" % tmp_path):
        load_flight_records(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_flight_records(tmp_path / "absent")


def test_rank_lists_are_written_as_ranges():
    assert rank_list([5, 4, 0, 2]) == "0, 2, 4, 5"
    assert rank_list([5, 4, 0, 2], shortest_range=2) == "0, 2, 4-5"
    assert rank_list(range(7)) == "0-6"
    assert rank_list([]) == "none"


# ---------------------------------------------------------------- hang report parts

WAIT_WHERE = {"file": "train.py", "line": 61, "function": "synchronize"}
EVAL_STACK = [{"file": "train.py", "line": 120, "function": "<module>", "code": "main()"},
              {"file": "train.py", "line": 101, "function": "main", "code": "run_epoch()"},
              {"file": "train.py", "line": 95, "function": "run_epoch", "code": "evaluate()"},
              {"file": "train.py", "line": 88, "function": "evaluate",
               "code": "loss = model(batch)"}]


def pending(name, submitted, missing, waited, kind="allreduce"):
    return {"name": name, "kind": kind, "set": 0, "submitted": submitted, "missing": missing,
            "waited": waited, "mine": False}


def write_hang_part(directory, rank, report=1, size=8, pending_list=(), stack=None, host=None,
                    recent=None, reason="stall"):
    where = dict(stack[-1]) if stack else WAIT_WHERE
    thread = {"name": "MainThread", "main": True, "waits_in_ringsync": stack is None,
              "where": {k: where[k] for k in ("file", "line", "function")},
              "stack": stack or [dict(WAIT_WHERE, code="optimizer.synchronize()")]}
    part = {"format": "ringsync-hang-report", "version": 1, "report": report,
            "reason": reason, "rank": rank, "size": size, "host": host or "a", "pid": 99,
            "written_at": 500.0, "pending": list(pending_list), "threads": [thread],
            "recent": recent if recent is not None else steps(["grad.fc1.weight"], 2)}
    (directory / ("hang-%d-rank-%d.json" % (report, rank))).write_text(json.dumps(part))


def eight_ranks_rank_7_in_evaluate(directory, report=1, answering=range(8)):
    """Ranks 0-6 wait on 'grad.fc2.weight'; rank 7 is evaluating. Ranks 0-2 took their view
    before ranks 5 and 6 had submitted it."""
    for rank in answering:
        if rank == 7:
            write_hang_part(directory, 7, report, stack=EVAL_STACK, host="b",
                            recent=steps(["loss"], 1))
            continue
        early = rank < 3
        view = pending("grad.fc2.weight", list(range(5 if early else 7)),
                       [5, 6, 7] if early else [7], 11.0 if early else 12.3)
        write_hang_part(directory, rank, report, pending_list=[view])


def test_the_merged_report_names_the_missing_rank_and_where_it_is(tmp_path):
    eight_ranks_rank_7_in_evaluate(tmp_path)
    report_id, parts = load_hang_parts(tmp_path)
    lines = format_hang_report(parts).splitlines()
    assert report_id == 1
    assert lines[0] == "ringsync hang report 1 (stall): 8 of 8 ranks answered"
    assert lines[1] == ("allreduce 'grad.fc2.weight': submitted by 0-6, missing on 7 "
                        "(waiting 12.3 s)")
    assert lines[2] == "rank 7 (host b) is in evaluate() at train.py:88"
    assert lines[3:7] == ["    train.py:120 in <module>(): main()",
                          "    train.py:101 in main(): run_epoch()",
                          "    train.py:95 in run_epoch(): evaluate()",
                          "    train.py:88 in evaluate(): loss = model(batch)"]
    assert lines[7] == "ranks 0-6 wait in synchronize() at train.py:61"
    assert lines[8] == "last finished: allreduce 'grad.fc1.weight' on ranks 0-6; " \
                       "allreduce 'loss' on rank 7"
    assert len(lines) == 9


def test_ranks_without_a_part_are_listed(tmp_path):
    eight_ranks_rank_7_in_evaluate(tmp_path, answering=[0, 1, 2, 4, 6, 7])
    _report_id, parts = load_hang_parts(tmp_path)
    text = format_hang_report(parts)
    assert first_line(text) == "ringsync hang report 1 (stall): 6 of 8 ranks answered"
    assert "no part from ranks 3, 5 (not reached or stuck)" in text.splitlines()
    # rank 6's view saw every submission; ranks 0-2's older view is not the one shown
    assert "allreduce 'grad.fc2.weight': submitted by 0-6, missing on 7" in text
    assert "ranks 0-2, 4, 6 wait in synchronize() at train.py:61" in text.splitlines()


def test_a_missing_rank_that_sent_no_part_is_said_to_be_unknown(tmp_path):
    eight_ranks_rank_7_in_evaluate(tmp_path, answering=range(7))
    text = format_hang_report(load_hang_parts(tmp_path)[1])
    assert "rank 7 sent no part, so where it is is unknown" in text.splitlines()
    assert "no part from rank 7 (not reached or stuck)" in text.splitlines()
    assert "evaluate" not in text


def test_the_latest_report_is_read_unless_an_id_is_asked_for(tmp_path):
    eight_ranks_rank_7_in_evaluate(tmp_path, report=1)
    for rank in range(4):
        write_hang_part(tmp_path, rank, report=2, size=4, reason="signal", pending_list=[
            pending("emb", [0, 2, 3], [1], 3.0, kind="allgather")])
    report_id, parts = load_hang_parts(tmp_path)
    assert (report_id, sorted(parts)) == (2, [0, 1, 2, 3])
    assert format_hang_report(parts).splitlines()[:2] == [
        "ringsync hang report 2 (signal): 4 of 4 ranks answered",
        "allgather 'emb': submitted by 0, 2-3, missing on 1 (waiting 3.0 s)"]
    report_id, parts = load_hang_parts(tmp_path, report=1)
    assert (report_id, len(parts)) == (1, 8)
    with pytest.raises(FileNotFoundError, match=r"no hang report 5 .*reports 1, 2"):
        load_hang_parts(tmp_path, report=5)


def test_broken_hang_parts_are_skipped_and_an_empty_directory_refused(tmp_path):
    eight_ranks_rank_7_in_evaluate(tmp_path, answering=[0, 7])
    (tmp_path / "hang-1-rank-3.json").write_text('{"format": "ringsync-hang-report"')
    part = json.loads((tmp_path / "hang-1-rank-0.json").read_text())
    part.update(rank=4, pending=[{"name": "x"}])
    (tmp_path / "hang-1-rank-4.json").write_text(json.dumps(part))
    with pytest.warns(UserWarning) as warned:
        _report_id, parts = load_hang_parts(tmp_path)
    assert sorted(parts) == [0, 7]
    assert sorted(Path(str(w.message).split(": ")[0].split()[-1]).name for w in warned) == [
        "hang-1-rank-3.json", "hang-1-rank-4.json"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no hang report parts .* in %s" % empty):
        load_hang_parts(empty)


# ---------------------------------------------------------------- the commands

def test_ringsync_trace_prints_the_divergence(tmp_path, capsys):
    mismatch_files(tmp_path, odd_rank=1, size=3, shape=(5,))
    (tmp_path / "rank-7.json").write_text("garbage")
    assert cli.main(["trace", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    assert first_line(printed.out) == (
        "rank 1 issued allreduce 'x' with shape [5] where ranks 0, 2 issued shape [4].")
    assert "ringsync trace: skipped %s" % (tmp_path / "rank-7.json") in printed.err


def test_ringsync_report_prints_the_merged_report_and_takes_an_id(tmp_path, capsys):
    eight_ranks_rank_7_in_evaluate(tmp_path, report=1)
    write_hang_part(tmp_path, 0, report=2, size=2)
    assert cli.main(["report", str(tmp_path)]) == 0
    assert first_line(capsys.readouterr().out) == (
        "ringsync hang report 2 (stall): 1 of 2 ranks answered")
    assert cli.main(["report", str(tmp_path), "--id", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 7 (host b) is in evaluate() at train.py:88" in out.splitlines()


@pytest.mark.parametrize("command", ["trace", "report"])
def test_nothing_to_read_exits_2_saying_why(tmp_path, capsys, command):
    assert cli.main([command, str(tmp_path / "absent")]) == 2
    assert "ringsync %s: error: %s: no such directory" % (
        command, tmp_path / "absent") in capsys.readouterr().err
    assert cli.main([command, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ringsync %s: error: no " % command in err and str(tmp_path) in err


def test_the_readers_import_nothing_but_the_standard_library_and_themselves():
    # They must run where the native core was never built: a laptop with the job's files.
    package = Path(__file__).resolve().parents[2] / "ringsync" / "diagnose"
    imported = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module)
    foreign = {name for name in imported if not name.startswith("ringsync.diagnose")
               and name.split(".")[0] not in sys.stdlib_module_names}
    assert not foreign


def test_count_hang_parts_counts_each_reports_parts_by_name(tmp_path):
    from ringsync.diagnose import count_hang_parts
    for name in ["hang-1-rank-0.json", "hang-1-rank-1.json", "hang-2-rank-0.json",
                 "hang-2-rank-0.json.tmp-9", "rank-0.json", "hang-x-rank-0.json"]:
        (tmp_path / name).write_text("{}")
    assert count_hang_parts(str(tmp_path)) == {1: 2, 2: 1}
    assert count_hang_parts(str(tmp_path / "missing")) == {}
