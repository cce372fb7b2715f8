"""Flight records read back: where the ranks of a failed job diverged.

Each rank's flight recorder keeps its last collectives and writes them, when something goes
wrong, to ``DIR/rank-<R>.json``. Ranks submit the same collectives in any order (the engine
matches them by name), names repeat every training step and every rank keeps only its last
N records, so records are matched across ranks by (process set, name) and by time, never by
their position in the files.

The pieces ringsync.diagnose.hang shares (reading one kind of part from a directory, rank
lists, a collective's label, tables) live here too: a hang report's recent records are
flight records. Standard library only, and nothing of ringsync's native core: these readers
run on a laptop with the job's files copied over.
"""

from __future__ import annotations

import json
import os
import re
import warnings

FLIGHT_FORMAT = "ringsync-flight-recorder"
FLIGHT_FILE = re.compile(r"rank-(?P<rank>\d+)\.json")
FORMAT_VERSION = 1
MAX_PART_BYTES = 64 << 20  # a part is kilobytes; a file this big is not one
RECORD_FIELDS = (("name", str), ("kind", str), ("result", str), ("set", int), ("start", float))
METADATA = ("kind", "op", "dtype", "shape")  # what the engine compares across ranks
WHY_IN_SENTENCE = 120
WHY_IN_TABLE = 60
LOST_PEER = "CommunicationError"  # exactly: a timeout says "stuck", not "gone"
STILL_RUNNING = "running"


# ---------------------------------------------------------------- reading parts

def load_flight_records(directory) -> dict:
    """{rank: its flight record file} from DIR/rank-<R>.json. A file with such a name that
    is not a flight record is skipped with a warning; no flight record at all is an error
    (FileNotFoundError naming the directory)."""
    parts = read_parts(directory, FLIGHT_FILE, FLIGHT_FORMAT, flight_file_problem)
    if not parts:
        raise FileNotFoundError("no flight records (rank-<R>.json) in %s" % directory)
    return {rank: part for (rank,), part in parts.items()}


def read_parts(directory, pattern, part_format, problem_of) -> dict:
    """{the numbers in the file's name, in pattern order: part} for every file of
    `directory` whose whole name matches `pattern` and that holds a part of `part_format`
    that `problem_of` finds nothing wrong with. Other names are not ours and are passed
    over in silence; a name of ours with bad contents is skipped with a warning (a rank
    killed while writing leaves half a file)."""
    parts = {}
    for name in sorted(directory_entries(directory)):
        match = pattern.fullmatch(name)
        if match is None:
            continue
        numbers = {key: int(value) for key, value in match.groupdict().items()}
        path = os.path.join(directory, name)
        part, problem = read_part(path, part_format, numbers, problem_of)
        if problem:
            warnings.warn("skipped %s: %s" % (path, problem), stacklevel=3)
        else:
            parts[tuple(numbers.values())] = part
    return parts


def directory_entries(directory) -> list:
    if not os.path.exists(directory):
        raise FileNotFoundError("%s: no such directory" % directory)
    if not os.path.isdir(directory):
        raise NotADirectoryError("%s is not a directory" % directory)
    return os.listdir(directory)


def read_part(path, part_format, numbers, problem_of) -> tuple:
    """(the parsed part, None), or (None, what is wrong with the file in words)."""
    try:
        if os.path.getsize(path) > MAX_PART_BYTES:
            return None, "larger than %d MiB" % (MAX_PART_BYTES >> 20)
        with open(path, encoding="utf-8") as file:
            part = json.load(file, parse_constant=refuse_constant)
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        return None, "unreadable (%s)" % exc
    return part, header_problem(part, part_format, numbers) or problem_of(part)


def refuse_constant(name):
    # json.load takes NaN and Infinity by default; as a time they would break every sort.
    raise ValueError("%s is not a number a rank writes" % name)


def header_problem(part, part_format, numbers):
    """What is wrong with the fields every part has, or None. `numbers` (rank, report id)
    come from the file's name and must agree with its contents."""
    if not isinstance(part, dict) or part.get("format") != part_format:
        return "not a %s file" % part_format
    if part.get("version") != FORMAT_VERSION:
        return "version %r (this reader knows %d)" % (part.get("version"), FORMAT_VERSION)
    for key, value in numbers.items():
        if not has_type(part.get(key), int) or part[key] != value:
            return "its %s is %r where its name says %d" % (key, part.get(key), value)
    if not has_type(part.get("size"), int) or not 0 <= part.get("rank", 0) < part["size"]:
        return "its size %r does not hold its rank" % (part.get("size"),)
    if not has_type(part.get("written_at"), float):
        return "its written_at is %r" % (part.get("written_at"),)
    return None


def flight_file_problem(part):
    return list_problem(part.get("records"), "records", record_problem)


def list_problem(items, what, problem_of):
    """The first problem of an item of `items`, or None; `items` must be a list."""
    if not isinstance(items, list):
        return "its %s are not a list" % what
    return next((problem for problem in map(problem_of, items) if problem), None)


def record_problem(record):
    if not isinstance(record, dict):
        return "a record is not an object"
    for key, kind in RECORD_FIELDS:
        if not has_type(record.get(key), kind):
            return "a record's %s is %r" % (key, record.get(key))
    if record.get("end") is not None and not has_type(record["end"], float):
        return "a record's end is %r" % (record["end"],)
    return None


def has_type(value, kind) -> bool:
    """isinstance, except that a bool is no number and an int is a float."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


# ---------------------------------------------------------------- words shared with hang

def job_size(parts: dict) -> int:
    """The job's rank count as the parts tell it (0 where there are none)."""
    sizes = [part["size"] for part in parts.values()] + [rank + 1 for rank in parts]
    return max(sizes, default=0)


def rank_list(ranks, shortest_range=3) -> str:
    """"0, 2, 4-9": runs of at least `shortest_range` consecutive ranks written as ranges
    (a job of 512 ranks must still fit a line)."""
    ranks = sorted(set(ranks))
    words, start = [], 0
    while start < len(ranks):
        end = start
        while end + 1 < len(ranks) and ranks[end + 1] == ranks[end] + 1:
            end += 1
        if end - start + 1 >= shortest_range:
            words.append("%d-%d" % (ranks[start], ranks[end]))
        else:
            words += [str(rank) for rank in ranks[start:end + 1]]
        start = end + 1
    return ", ".join(words) or "none"


def ranks_phrase(ranks, shortest_range=3) -> str:
    """"rank 3" or "ranks 0, 2"."""
    ranks = sorted(set(ranks))
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_list(ranks, shortest_range)


def plural(ranks, one, many) -> str:
    return one if len(set(ranks)) == 1 else many


def label(record) -> str:
    """"allreduce 'grad.w'": how a collective is named in every sentence."""
    return "%s '%s'" % (record["kind"], record["name"])


def one_line(text, limit) -> str:
    """`text` on one line (a why may hold a whole traceback), cut after `limit` characters."""
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[:limit] + "..."


def group_ranks(value_of: dict) -> list:
    """[(value, [ranks])] for {rank: value}, in the order of each value's first rank."""
    groups = {}
    for rank in sorted(value_of):
        groups.setdefault(value_of[rank], []).append(rank)
    return list(groups.items())


def format_table(header, rows) -> str:
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths))
                     .rstrip() for row in [header] + rows)


# ---------------------------------------------------------------- finding the divergence

def describe_divergence(files: dict, size=None) -> str:
    """One sentence saying where the ranks diverged, then a table of every rank."""
    size = size or job_size(files)
    missing = [rank for rank in range(size) if rank not in files]
    return "%s.\n\n%s" % (divergence_sentence(files, missing), rank_table(files, size))


def divergence_sentence(files, missing) -> str:
    failure = first_failure(files)
    if failure is None:
        return with_missing("no rank recorded a failed or unfinished collective", missing)
    taking_part = occurrences(files, failure)
    skipping = [rank for rank in sorted(files) if rank not in taking_part
                and window_covers(files[rank], failure["start"])]
    sentence = (mismatch_sentence(taking_part)
                or skip_sentence(files, failure, taking_part, skipping))
    if sentence is None and missing:
        sentence = lost_sentence(files, failure, taking_part, missing)
        if sentence:
            return sentence
    return with_missing(sentence or failed_sentence(files, failure, taking_part), missing)


def is_ok(record) -> bool:
    return record["result"] == "ok"


def same_collective(record, other) -> bool:
    return (record["set"], record["name"]) == (other["set"], other["name"])


def first_failure(files):
    """The record of the collective that went wrong first, or None.

    Of the collectives some rank did not finish ok, the one the most ranks are in, the
    earliest started of those. Counting ranks first matters where ranks diverge: a rank
    that skipped 'x' may have entered 'y' a moment before the others entered 'x', and the
    story is that one rank is in 'y', not that all the others are missing from it.
    """
    ranks_in, earliest = {}, {}
    for rank, part in files.items():
        for record in part["records"]:
            if is_ok(record):
                continue
            key = (record["set"], record["name"])
            ranks_in.setdefault(key, set()).add(rank)
            if key not in earliest or record["start"] < earliest[key]["start"]:
                earliest[key] = record
    if not earliest:
        return None
    return earliest[max(earliest, key=lambda k: (len(ranks_in[k]), -earliest[k]["start"]))]


def occurrences(files, failure) -> dict:
    """{rank: its record of the failed collective}. On each rank, of its records of that
    (set, name) that did not end ok, the one started closest to `failure`: a record of the
    same name that ended ok belongs to another step (a collective completes only once
    every rank has submitted it)."""
    found = {}
    for rank, part in files.items():
        candidates = [record for record in part["records"]
                      if not is_ok(record) and same_collective(record, failure)]
        if candidates:
            found[rank] = min(candidates, key=lambda r: abs(r["start"] - failure["start"]))
    return found


def window_covers(part, when) -> bool:
    """Whether the rank's kept records would show a collective it entered at `when`: they
    begin before then (the ring buffer dropped nothing after it), and the rank was still
    there to write its file afterwards."""
    records = part["records"]
    began = records[0]["start"] if records else float("-inf")
    return began <= when <= part["written_at"]


def metadata(record) -> tuple:
    return tuple(json.dumps(record.get(field)) for field in METADATA)


def mismatch_sentence(taking_part):
    """"rank 1 issued allreduce 'x' with shape [5] where ranks 0, 2 issued shape [4]", or
    None where every rank issued the same call. With no majority, every group is named:
    "rank 0 issued ... and rank 1 issued ..."."""
    groups = group_ranks({rank: metadata(record) for rank, record in taking_part.items()})
    if len(groups) < 2:
        return None
    groups.sort(key=lambda group: -len(group[1]))  # stable: ties keep the lowest rank first
    calls = [(ranks, taking_part[ranks[0]]) for _value, ranks in groups]
    fields = [f for i, f in enumerate(METADATA) if len({g[0][i] for g in groups}) > 1]
    if len(calls[0][0]) > len(calls[1][0]):
        odd = " and ".join(issued(ranks, record, fields, i == 0)
                           for i, (ranks, record) in enumerate(calls[1:]))
        majority_ranks, majority = calls[0]
        return "%s where %s" % (odd, issued(majority_ranks, majority, fields, False))
    return " and ".join(issued(ranks, record, fields, i == 0)
                        for i, (ranks, record) in enumerate(calls))


def issued(ranks, record, fields, with_label) -> str:
    """"rank 1 issued allreduce 'x' with shape [5]"; without the label ("ranks 0, 2 issued
    shape [4]") unless the kinds differ, which only the label shows."""
    words = [label(record)] if with_label or "kind" in fields else []
    values = ", ".join("%s %s" % (field, show(record.get(field)))
                       for field in fields if field != "kind")
    if values:
        words.append(("with " if words else "") + values)
    return "%s issued %s" % (ranks_phrase(ranks), " ".join(words))


def show(value) -> str:
    return "none" if value is None else json.dumps(value) if isinstance(value, list) else str(value)


def skip_sentence(files, failure, taking_part, skipping):
    """"rank 2 did not issue allreduce 'x' (ranks 0, 1 did); its last collective was
    allgather 'y' (running)", or None where no rank skipped it."""
    if not skipping:
        return None
    return "%s did not issue %s (%s did); %s" % (
        ranks_phrase(skipping), label(failure), ranks_phrase(taking_part),
        last_collectives(files, skipping))


def last_collectives(files, ranks) -> str:
    groups = group_ranks({rank: last_call(files[rank]) for rank in ranks})
    if len(groups) == 1:
        return "%s last collective was %s" % (plural(ranks, "its", "their"), groups[0][0])
    return "their last collectives: " + ", ".join(
        "%s on %s" % (call, ranks_phrase(group)) for call, group in groups)


def last_call(part) -> str:
    if not part["records"]:
        return "none recorded"
    record = part["records"][-1]
    return label(record) + ("" if is_ok(record) else " (%s)" % record["result"])


def lost_sentence(files, failure, taking_part, missing):
    """"rank 1 left no flight record; ranks 0, 2, 3 failed in allreduce 'grad.w'
    (CommunicationError: ...): rank 1 was lost there", or None where no rank lost a peer."""
    failed = sorted(rank for rank, record in taking_part.items() if record["result"] == LOST_PEER)
    if not failed:
        return None
    return "%s left no flight record; %s failed in %s (%s): %s %s lost there" % (
        ranks_phrase(missing), ranks_phrase(failed), label(failure),
        first_why(files, taking_part, failed), ranks_phrase(missing),
        plural(missing, "was", "were"))


def failed_sentence(files, failure, taking_part) -> str:
    """"ranks 0, 1 failed in allreduce 'x' (CommunicationTimeout: ...); rank 2 was still in
    it", or where none failed, that they were all still in it when they wrote."""
    failed = [rank for rank, record in taking_part.items() if record["result"] != STILL_RUNNING]
    running = [rank for rank in taking_part if rank not in failed]
    if not failed:
        return "%s %s still in %s when they wrote their records (%s)" % (
            ranks_phrase(running), plural(running, "was", "were"), label(failure),
            first_why(files, taking_part, running))
    sentence = "%s failed in %s (%s)" % (ranks_phrase(failed), label(failure),
                                         first_why(files, taking_part, failed))
    if running:
        sentence += "; %s %s still in it" % (ranks_phrase(running), plural(running, "was", "were"))
    return sentence


def first_why(files, taking_part, ranks) -> str:
    """The why of whichever of `ranks` entered the collective first, led by its result
    (where the why does not already say it) and cut to one sentence's worth."""
    rank = min(ranks, key=lambda r: (taking_part[r]["start"], r))
    why, result = one_line(files[rank].get("why"), WHY_IN_SENTENCE), taking_part[rank]["result"]
    if result == STILL_RUNNING or why.startswith(result):
        return why or result
    return "%s: %s" % (result, why) if why else result


def with_missing(sentence, missing) -> str:
    if not missing:
        return sentence
    return "%s; %s left no flight record (killed, or %s never saw a failure)" % (
        sentence, ranks_phrase(missing), plural(missing, "it", "they"))


def rank_table(files, size) -> str:
    header = ["rank", "host", "kept", "last ok", "first not ok", "why"]
    rows = [table_row(rank, files.get(rank)) for rank in sorted(set(range(size)) | set(files))]
    return format_table(header, rows)


def table_row(rank, part) -> list:
    if part is None:
        return [rank, "-", "-", "-", "-", "(no flight record)"]
    records = part["records"]
    last_ok = next((label(r) for r in reversed(records) if is_ok(r)), "-")
    first_bad = next(("%s (%s)" % (label(r), r["result"]) for r in records if not is_ok(r)), "-")
    return [rank, part.get("host", "?"), len(records), last_ok, first_bad,
            one_line(part.get("why"), WHY_IN_TABLE)]
