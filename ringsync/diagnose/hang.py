"""Hang reports merged: which collective the job waits on, and where the ranks that never
submitted it are instead.

On a stall, a signal or a request, every rank that can answers with a part,
``DIR/hang-<id>-rank-<R>.json``: the collectives pending in its view (who submitted them,
who is missing), its threads' stacks and its last few flight records. A directory may hold
several reports of one job (ids increase); the latest is read unless one is asked for.
Rank lists here are written as ranges ("0-6", "4-5"): hang reports come from big jobs.
"""

from __future__ import annotations

import os
import re

from ringsync.diagnose.trace import (group_ranks, has_type, job_size, label, list_problem,
                                     rank_list, ranks_phrase, read_parts, record_problem)

HANG_FORMAT = "ringsync-hang-report"
HANG_FILE = re.compile(r"hang-(?P<report>\d+)-rank-(?P<rank>\d+)\.json")
RANGES_FROM = 2  # the shortest run of ranks written as a range
STACK_FRAMES = 5  # innermost frames shown of a missing rank's stack
PENDING_FIELDS = (("name", str), ("kind", str), ("set", int), ("waited", float))
FRAME_FIELDS = (("file", str), ("line", int), ("function", str))


# ---------------------------------------------------------------- reading parts

def count_hang_parts(directory) -> dict:
    """{report id: parts present} in directory, by their names alone (nothing is read: for
    whoever waits until a report's parts are in); {} where it cannot be listed."""
    counts = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return counts
    for name in names:
        match = HANG_FILE.fullmatch(name)
        if match:
            report = int(match.group("report"))
            counts[report] = counts.get(report, 0) + 1
    return counts


def load_hang_parts(directory, report=None) -> tuple:
    """(report id, {rank: its part}) of report `report`, or of the latest one in
    `directory`. A file named as a part that is not one is skipped with a warning; a
    directory with no part (or none of the report asked for) is a FileNotFoundError."""
    parts = read_parts(directory, HANG_FILE, HANG_FORMAT, hang_part_problem)
    ids = sorted({report_id for report_id, _rank in parts})
    if not ids:
        raise FileNotFoundError("no hang report parts (hang-<id>-rank-<R>.json) in %s"
                                % directory)
    chosen = ids[-1] if report is None else report
    if chosen not in ids:
        raise FileNotFoundError("no hang report %s in %s (it holds report%s %s)" % (
            chosen, directory, "" if len(ids) == 1 else "s", ", ".join(map(str, ids))))
    return chosen, {rank: part for (report_id, rank), part in parts.items()
                    if report_id == chosen}


def hang_part_problem(part):
    if not isinstance(part.get("reason"), str):
        return "its reason is %r" % (part.get("reason"),)
    return (list_problem(part.get("pending"), "pending", pending_problem)
            or list_problem(part.get("threads"), "threads", thread_problem)
            or list_problem(part.get("recent"), "recent records", record_problem))


def pending_problem(entry):
    if not isinstance(entry, dict):
        return "a pending entry is not an object"
    problem = fields_problem(entry, PENDING_FIELDS, "pending entry")
    bad = [key for key in ("submitted", "missing") if not is_rank_list(entry.get(key))]
    if problem or not bad:
        return problem
    return "a pending entry's %s is %r" % (bad[0], entry.get(bad[0]))


def is_rank_list(ranks) -> bool:
    return isinstance(ranks, list) and all(has_type(rank, int) for rank in ranks)


def thread_problem(thread):
    if not isinstance(thread, dict):
        return "a thread is not an object"
    where = thread.get("where")
    problem = frame_problem(where) if where is not None else None
    if problem:
        return "a thread's where: " + problem
    return list_problem(thread.get("stack"), "stack frames", frame_problem)


def frame_problem(frame):
    if not isinstance(frame, dict):
        return "a frame is not an object"
    return fields_problem(frame, FRAME_FIELDS, "frame")


def fields_problem(item, fields, what):
    return next(("a %s's %s is %r" % (what, key, item.get(key))
                 for key, kind in fields if not has_type(item.get(key), kind)), None)


# ---------------------------------------------------------------- the merged report

def format_hang_report(parts: dict, size=None) -> str:
    """One merged report: the pending collectives, where each rank missing from one is,
    where the others wait, which ranks sent nothing, and each rank's last finished
    collective."""
    size = size or job_size(parts)
    pending = merged_pending(parts)
    stuck = sorted({rank for entry in pending for rank in entry["missing"]})
    lines = [headline(parts, size)]
    lines += [pending_line(entry) for entry in pending] or [
        "no collective was pending on the ranks that answered"]
    for rank in stuck:
        lines += missing_rank_lines(parts.get(rank), rank)
    lines += waiting_lines(parts, stuck) + absent_lines(parts, size)
    lines += last_finished_lines(parts)
    return "\n".join(lines)


def headline(parts, size) -> str:
    ids = sorted({part["report"] for part in parts.values()})
    reasons = sorted({part["reason"] for part in parts.values()})
    return "ringsync hang report %s (%s): %d of %d ranks answered" % (
        ", ".join(map(str, ids)) or "?", ", ".join(reasons) or "?", len(parts), size)


def merged_pending(parts) -> list:
    """Every pending collective once, longest waiting first. Of the ranks' views of one,
    the one that saw the most submissions: the others were taken before the last ranks'
    submissions reached them."""
    views = {}
    for part in parts.values():
        for entry in part["pending"]:
            key = (entry["set"], entry["name"])
            if key not in views or seen(entry) > seen(views[key]):
                views[key] = entry
    return sorted(views.values(), key=lambda entry: (-entry["waited"], entry["name"]))


def seen(entry) -> tuple:
    return len(set(entry["submitted"])), entry["waited"]


def pending_line(entry) -> str:
    """"allreduce 'grad.fc2.weight': submitted by 0-6, missing on 7 (waiting 12.3 s)"."""
    where = " in process set %d" % entry["set"] if entry["set"] else ""
    missing = ", missing on %s" % rank_list(entry["missing"], RANGES_FROM) \
        if entry["missing"] else ""
    return "%s%s: submitted by %s%s (waiting %.1f s)" % (
        label(entry), where, rank_list(entry["submitted"], RANGES_FROM), missing,
        entry["waited"])


def missing_rank_lines(part, rank) -> list:
    """"rank 7 (host b) is in evaluate() at train.py:88" and its innermost frames."""
    if part is None:
        return ["rank %d sent no part, so where it is is unknown" % rank]
    thread = main_thread(part)
    lines = ["rank %d (host %s) is in %s" % (rank, part.get("host", "?"), place(thread))]
    frames = thread["stack"][-STACK_FRAMES:] if thread else []
    return lines + ["    %s:%d in %s()%s" % (frame["file"], frame["line"], frame["function"],
                                              code_of(frame)) for frame in frames]


def code_of(frame) -> str:
    code = str(frame.get("code") or "").strip()
    return ": " + code if code else ""


def main_thread(part):
    threads = part["threads"]
    return next((t for t in threads if t.get("main")), threads[0] if threads else None)


def waiting_thread(part):
    """The thread blocked in ringsync, where there is one: a rank's main thread may be
    elsewhere while another thread waits (a data loader, an asynchronous step)."""
    return next((t for t in part["threads"] if t.get("waits_in_ringsync")), main_thread(part))


def place(thread) -> str:
    """"evaluate() at train.py:88"."""
    where = thread.get("where") if thread else None
    if not where:
        return "an unknown place (no stack)"
    return "%s() at %s:%d" % (where["function"], where["file"], where["line"])


def waiting_lines(parts, stuck) -> list:
    """One line: "ranks 0-6 wait in synchronize() at train.py:61; rank 3 waits in ..."."""
    others = {rank: place(waiting_thread(part)) for rank, part in parts.items()
              if rank not in stuck}
    if not others:
        return []
    return ["; ".join("%s %s in %s" % (ranks_phrase(ranks, RANGES_FROM),
                                      "waits" if len(ranks) == 1 else "wait", where)
                      for where, ranks in group_ranks(others))]


def absent_lines(parts, size) -> list:
    absent = [rank for rank in range(size) if rank not in parts]
    if not absent:
        return []
    return ["no part from %s (not reached or stuck)" % ranks_phrase(absent, RANGES_FROM)]


def last_finished_lines(parts) -> list:
    """"last finished: allreduce 'grad.fc1.weight' on ranks 0-6; none recorded on rank 7"."""
    if not parts:
        return []
    last = {rank: last_finished(part) for rank, part in parts.items()}
    return ["last finished: " + "; ".join(
        "%s on %s" % (call, ranks_phrase(ranks, RANGES_FROM))
        for call, ranks in group_ranks(last))]


def last_finished(part) -> str:
    finished = [record for record in part["recent"] if record.get("end") is not None]
    return label(finished[-1]) if finished else "none recorded"
