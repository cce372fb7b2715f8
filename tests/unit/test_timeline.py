"""The timeline with ranks as threads (tests/thread_ranks.py): one file with every rank's
events at stop_timeline(), ranks with their own path keep their own events, and a ring
that cannot gather leaves each rank's events in path.rank<r>. (Under mpirun, through
`ringsync run --timeline-filename`: tests/mpi/test_launcher.py.)"""
import json

import numpy as np

from ringsync._timeline import merge_traces
from tests.thread_ranks import assert_ranks_ok

NAMES = [f"tl.{i}" for i in range(3)]


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
    assert tracks_by_rank(events) == {rank: set(NAMES) for rank in range(3)}
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
        assert list(tracks) == [rank] and set(NAMES) <= tracks[rank]  # (and the barrier)
    assert not any(p.name.endswith(".part") for p in tmp_path.iterdir())


def test_merge_shifts_only_the_ranks_it_is_told_to():
    parts = [{"traceEvents": [{"ph": "X", "ts": 10.0, "pid": 0}]},
             {"traceEvents": [{"ph": "M", "pid": 1}, {"ph": "X", "ts": 10.0, "pid": 1}]}]
    merged = merge_traces(parts, [0.0, 5.0])["traceEvents"]
    assert [e.get("ts") for e in merged] == [10.0, None, 15.0]
