"""The timeline with ranks as threads (tests/thread_ranks.py): one file with every rank's
events at stop_timeline(), ranks with their own path keep their own events, and a ring
that cannot gather leaves each rank's events in path.rank<r>. (Under mpirun, through
`ringsync run --timeline-filename`: tests/mpi/test_launcher.py.)"""
import json

import numpy as np

from ringsync._timeline import merge_traces
from tests.thread_ranks import assert_ranks_ok

NAMES = [f"tl.{i}" for i in range(3)]
TRACKS = {f"allreduce.{name}" for name in NAMES}  # Horovod's names for them


def record(comm, path, stop=True):
    comm.start_timeline(str(path), mark_cycles=True)
    handles = [comm.allreduce_async(np.full(64, comm.rank(), np.float32), name=name)
               for name in NAMES]
    for handle in handles:
        comm.synchronize(handle)
    if stop:
        comm.stop_timeline()


def tracks_by_rank(events):
    tracks = {}
    for e in events:
        if e.get("name") == "thread_name":
            tracks.setdefault(e["pid"], set()).add(e["args"]["name"])
    return tracks


def test_stop_timeline_writes_every_ranks_events_to_one_file(tmp_path):
    path = tmp_path / "trace.json"
    assert_ranks_ok(record, 3, args=(path,), env={"RINGSYNC_TRANSPORT": "tcp"})
    events = json.loads(path.read_text())["traceEvents"]
    assert tracks_by_rank(events) == {rank: TRACKS for rank in range(3)}
    cycles = {e["pid"] for e in events if e.get("name") == "CYCLE_START"}
    assert cycles == {0, 1, 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]  # no parts left


def test_a_rank_with_its_own_path_keeps_its_own_events(tmp_path):
    def body(comm):
        record(comm, tmp_path / ("mine.json" if comm.rank() == 1 else "shared.json"))
    assert_ranks_ok(body, 3, env={"RINGSYNC_TRANSPORT": "tcp"})
    shared = json.loads((tmp_path / "shared.json").read_text())["traceEvents"]
    assert set(tracks_by_rank(shared)) == {0, 2}
    mine = json.loads((tmp_path / "mine.json").read_text())["traceEvents"]
    assert set(tracks_by_rank(mine)) == {1}


def test_an_aborted_ring_leaves_each_ranks_events_beside_the_path(tmp_path):
    path = tmp_path / "trace.json"

    def body(comm):
        record(comm, path, stop=False)
        comm.barrier()
        comm.abort("test")  # an elastic recovery does this: no gather is possible
    assert_ranks_ok(body, 2, env={"RINGSYNC_TRANSPORT": "tcp"})
    for rank in range(2):
        events = json.loads((tmp_path / f"trace.json.rank{rank}").read_text())["traceEvents"]
        tracks = tracks_by_rank(events)
        assert list(tracks) == [rank] and TRACKS <= tracks[rank]  # (and the barrier)
    assert not any(p.name.endswith(".part") for p in tmp_path.iterdir())


def test_merge_shifts_only_the_ranks_it_is_told_to():
    parts = [{"traceEvents": [{"ph": "X", "ts": 10.0, "pid": 0}]},
             {"traceEvents": [{"ph": "M", "pid": 1}, {"ph": "X", "ts": 10.0, "pid": 1}]}]
    merged = merge_traces(parts, [0.0, 5.0])["traceEvents"]
    assert [e.get("ts") for e in merged] == [10.0, None, 15.0]


def _part_text(names):
    """A part as the engine writes it: header, one event per line, separators first."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}]
    for i, name in enumerate(names):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i + 1,
                       "args": {"name": name}})
        events.append({"name": "NEGOTIATE", "ph": "X", "pid": 0, "tid": i + 1, "ts": 1.5 * i,
                       "dur": 0.25, "args": {"tensor": name}})
    lines = [json.dumps(e, ensure_ascii=False) for e in events]
    return '{"displayTimeUnit": "ms", "traceEvents": [\n' + ",\n".join(lines), events


def test_part_reader_takes_each_event_once_however_the_part_is_flushed(tmp_path):
    from ringsync._timeline import PartReader
    names = [f"grad.{i}" for i in range(40)] + ["gewicht.ü", "名前", 'q"uote\\']
    text, events = _part_text(names)
    data = text.encode()
    rng = np.random.default_rng(7)
    for trial in range(20):  # blocks cut anywhere, inside UTF-8 characters too
        part = tmp_path / f"p{trial}.part"
        part.write_bytes(b"")
        reader, got = PartReader(str(part)), []
        cuts = sorted(rng.choice(len(data), size=12, replace=False).tolist()) + [len(data)]
        start = 0
        for cut in cuts:
            with open(part, "ab") as f:
                f.write(data[start:cut])
            start = cut
            got += [json.loads(e) for e in reader.new_events()]
        with open(part, "ab") as f:  # what stop_timeline() adds
            f.write(b"\n]}\n")
        got += [json.loads(e) for e in reader.new_events()]
        assert got == events, trial


def test_the_file_is_valid_json_with_rank_0s_events_while_the_job_runs(tmp_path):
    """Rank 0's events reach the file while the ranks still run (all but what the engine
    has not flushed: a block of a few KB); at stop_timeline() it holds every rank's."""
    path = tmp_path / "trace.json"
    names = [f"live.{i}" for i in range(300)]  # (far more than a flushed block)
    seen = {}

    def body(comm):
        comm.start_timeline(str(path))
        for i, name in enumerate(names):
            comm.allreduce(np.full(8, comm.rank() + i, np.float32), name=name)
        if comm.rank() == 0:
            seen["during"] = _wait_for_tracks(path, {f"allreduce.{n}" for n in names[:200]})
        comm.barrier()
        comm.stop_timeline()
    assert_ranks_ok(body, 3, env={"RINGSYNC_TRANSPORT": "tcp"})
    assert seen["during"] == {0}, seen  # only rank 0's, and every event of it valid JSON
    tracks = tracks_by_rank(json.loads(path.read_text())["traceEvents"])
    assert sorted(tracks) == [0, 1, 2] and all({f"allreduce.{n}" for n in names} <= t
                                               for t in tracks.values())


def _wait_for_tracks(path, wanted, deadline_s=60.0):
    """The ranks whose events the file holds, once it is valid JSON naming every wanted
    track of rank 0 (polls: rank 0 copies its events every half second)."""
    import time
    end = time.monotonic() + deadline_s
    while True:
        try:
            events = json.loads(path.read_text())["traceEvents"]
        except ValueError:
            events = []
        tracks = tracks_by_rank(events)
        if wanted <= tracks.get(0, set()) or time.monotonic() > end:
            assert wanted <= tracks.get(0, set()), \
                f"after {deadline_s} s the file names {len(tracks.get(0, ()))} of rank 0's tracks"
            return set(tracks)
        time.sleep(0.1)
