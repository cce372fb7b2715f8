"""ringsync.checkpoint, the framework-free format, on thread ranks: every kind of damage to
the newest generation (a part truncated, flipped, of another generation or rank, missing;
checkpoint.json missing, not JSON, edited) makes every rank raise the same CheckpointError
naming the file and what is wrong, no damaged part is unpickled, and the previous
generation still loads; a save stopped at any point leaves the latest named generation
loadable.

Each rank of N saves its slice [23r/N, 23(r+1)/N) of a 23-element vector that depends on
the save's step and on the position; a load assembles the whole vector from every part and
compares it with the reference for the step it read."""
import json
import os
import pickle
import shutil

import numpy as np
import pytest

from ringsync.checkpoint import GENERATION_META, META, CheckpointError, Codec, Parts, \
    agreed, generations, open_checkpoint, save_generation

from ringsync._atomic import temporary_path
from tests.thread_ranks import assert_ranks_ok

N = 23  # elements saved (a prime: the ranks' slices differ in size)
RANKS = 2
TIMEOUT = 60.0


class PickleCodec(Codec):
    """numpy arrays pickled; remembers every file it unpickled."""

    def __init__(self):
        self.loaded = []

    def flat_copy(self, tensor):
        return np.array(tensor, copy=True).reshape(-1)

    def numel(self, tensor):
        return int(np.size(tensor))

    def empty(self, n, like):
        return np.empty(n, dtype=like.dtype)

    def dumps(self, part):
        return pickle.dumps(part)

    def load(self, file):
        self.loaded.append(file)
        with open(file, "rb") as f:
            return pickle.load(f)


def _values(step):
    return np.arange(N, dtype=np.float64) * step + 0.25 * step


def _save(comm, path, step, codec, write=None):
    rank, size = comm.rank(), comm.size()
    lo, hi = N * rank // size, N * (rank + 1) // size
    parts = Parts(codec)
    parts.add_piece("w", _values(step)[lo:hi], lo, N)
    if rank == 0:
        parts.whole["extra"] = {"step": step}
    return save_generation(path, parts, comm, comm, write=write)


def _load(comm, path, codec, generation=None):
    """The step of the checkpoint loaded, its values checked against the reference."""
    reader = open_checkpoint(path, codec, comm, generation=generation)
    step = reader.whole("extra")["step"]
    np.testing.assert_array_equal(reader.range("w", 0, N, N), _values(step))
    return step


def _on_ranks(body, size=RANKS):
    return assert_ranks_ok(body, size, timeout=TIMEOUT)


def _part(path, generation=2, rank=0, ranks=RANKS):
    return os.path.join(path, f"gen-{generation}", f"rank-{rank}-of-{ranks}.pt")


def _read(file):
    with open(file, "rb") as f:
        return f.read()


def _write(file, data):
    with open(file, "wb") as f:
        f.write(data)


def _edit_json(file, **changes):
    meta = json.loads(_read(file))
    meta.update(changes)
    _write(file, json.dumps(meta).encode())


@pytest.fixture
def saved(tmp_path):
    """A checkpoint folder with generations 1 (step 1) and 2 (step 2), saved on 2 ranks."""
    path = str(tmp_path / "ckpt")
    codec = PickleCodec()
    assert _on_ranks(lambda comm: [_save(comm, path, s, codec) for s in (1, 2)]) == \
        [[1, 2]] * RANKS
    return path


def _fails_everywhere(path, codec, generation=None):
    """The message every rank raised loading generation (the same on every rank)."""
    def body(comm):
        try:
            _load(comm, path, codec, generation)
        except CheckpointError as e:
            return str(e)
        raise AssertionError("a damaged checkpoint loaded")
    messages = _on_ranks(body)
    assert len(set(messages)) == 1, messages
    return messages[0]


def _loads_everywhere(path, generation=None):
    steps = _on_ranks(lambda comm: _load(comm, path, PickleCodec(), generation))
    assert len(set(steps)) == 1, steps
    return steps[0]


# ---- damage to a part of generation 2: (file named, words) ----

def truncated(path):
    file = _part(path, rank=1)
    _write(file, _read(file)[:-7])
    return file, ["bytes", "records", "truncated"]


def flipped(path):
    file = _part(path, rank=1)
    data = bytearray(_read(file))
    data[len(data) // 2] ^= 0x10
    _write(file, bytes(data))
    return file, ["does not match its SHA-256", "damaged"]


def of_another_generation(path):
    file = _part(path, rank=0)
    shutil.copyfile(_part(path, generation=1, rank=0), file)
    return file, ["its bytes are those of gen-1/rank-0-of-2.pt (generation 1, rank 0 of 2)"]


def of_another_rank(path):
    file = _part(path, rank=0)
    shutil.copyfile(_part(path, rank=1), file)
    return file, ["its bytes are those of gen-2/rank-1-of-2.pt (generation 2, rank 1 of 2)"]


def missing(path):
    file = _part(path, rank=1)
    os.remove(file)
    return file, ["is missing"]


PART_DAMAGE = [truncated, flipped, of_another_generation, of_another_rank, missing]


@pytest.mark.parametrize("damage", PART_DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_part_fails_on_every_rank_and_the_previous_generation_loads(saved, damage):
    file, words = damage(saved)
    codec = PickleCodec()
    message = _fails_everywhere(saved, codec)
    for word in [file, *words, "generation 1 is intact: load(..., generation=1)"]:
        assert word in message, (word, message)
    assert codec.loaded == [], codec.loaded  # nothing was unpickled: the bytes came first
    assert _loads_everywhere(saved, generation=1) == 1
    assert generations(saved) == [1]


# ---- forgeries whose bytes match the metadata (edited to fit): the parts' own identity ----

def _refit(path, rank, file):
    """checkpoint.json edited so that its size and SHA-256 for rank are file's."""
    import hashlib
    meta = json.loads(_read(os.path.join(path, META)))
    meta["bytes"][rank] = os.path.getsize(file)
    meta["sha256"][rank] = hashlib.sha256(_read(file)).hexdigest()
    _write(os.path.join(path, META), json.dumps(meta).encode())


def refitted_other_generation(path):
    file = _part(path, rank=0)
    shutil.copyfile(_part(path, generation=1, rank=0), file)
    _refit(path, 0, file)
    return file, ["holds the part of generation 1, rank 0 of 2; generation 2, rank 0 of 2 "
                  "expected"]


def refitted_other_rank(path):
    zero, one = _part(path, rank=0), _part(path, rank=1)
    os.replace(zero, zero + ".x")
    os.replace(one, zero)
    os.replace(zero + ".x", one)
    _refit(path, 0, zero)
    _refit(path, 1, one)
    return zero, ["holds the part of generation 2, rank 1 of 2; generation 2, rank 0 of 2 "
                  "expected"]


def refitted_piece_out_of_range(path):
    file = _part(path, rank=1)
    part = pickle.loads(_read(file))
    part["pieces"]["w"][0]["b"] += 1 << 40
    _write(file, pickle.dumps(part))
    _refit(path, 1, file)
    return file, ["'w' has a piece", "out of [0, 23)"]


def refitted_unreadable(path):
    file = _part(path, rank=1)
    _write(file, b"not a pickle at all")
    _refit(path, 1, file)
    return file, ["cannot be read"]


@pytest.mark.parametrize("forge", [refitted_other_generation, refitted_other_rank,
                                   refitted_piece_out_of_range, refitted_unreadable],
                         ids=lambda f: f.__name__)
def test_a_part_that_is_not_the_one_expected_is_named_by_what_it_holds(saved, forge):
    file, words = forge(saved)
    message = _fails_everywhere(saved, PickleCodec())
    for word in [file, *words]:
        assert word in message, (word, message)
    assert _loads_everywhere(saved, generation=1) == 1
    # (by number, generation 2's own meta.json, untouched, refuses the forged part)
    by_number = _fails_everywhere(saved, PickleCodec(), generation=2)
    assert f"{file} has " in by_number or f"{file} does not match its SHA-256" in by_number
    assert os.path.join(saved, "gen-2", GENERATION_META) in by_number, by_number


# ---- damage to checkpoint.json: generation 2 itself is fine, by number ----

def _meta_edit(**changes):
    def edit(path):
        _edit_json(os.path.join(path, META), **changes)
    edit.__name__ = ",".join(f"{k}={v!r:.24}" for k, v in changes.items())
    return edit


def _meta_bytes(data):
    def replace(path):
        _write(os.path.join(path, META), data)
    replace.__name__ = f"checkpoint.json={data[:12]!r}"
    return replace


def _no_meta(path):
    os.remove(os.path.join(path, META))


META_DAMAGE = [
    (_no_meta, "no checkpoint in {path} ({path}/checkpoint.json is missing)"),
    (_meta_bytes(b'{"format": 2, "gener'), "is not JSON"),
    (_meta_bytes(b"\xff\xfe\x00garbage"), "is not JSON"),
    (_meta_bytes(b"[1, 2, 3]"), "it holds a list, not an object"),
    (_meta_edit(format=99), "'format' is 99; this ringsync reads formats [1, 2]"),
    (_meta_edit(format=True), "'format' is True"),
    (_meta_edit(generation="../.."), "'generation' is '../..', not an integer"),
    (_meta_edit(generation=0), "'generation' is 0, not an integer"),
    (_meta_edit(ranks="2"), "'ranks' is '2', not an integer in [1, 1048576]"),
    (_meta_edit(ranks=0), "'ranks' is 0, not an integer"),
    (_meta_edit(ranks=10 ** 12), "'ranks' is 1000000000000, not an integer"),
    (_meta_edit(ranks=3), "'bytes' has 2 entries; 'ranks' is 3, one entry per rank"),
    (_meta_edit(bytes=None), "'bytes' has None; 'ranks' is 2"),
    (_meta_edit(bytes=[100, -5]), "'bytes'[1] is -5, not a size in bytes"),
    (_meta_edit(bytes=[100, 2.5]), "'bytes'[1] is 2.5, not a size in bytes"),
    (_meta_edit(sha256=["0" * 64]), "'sha256' has 1 entries; 'ranks' is 2"),
    (_meta_edit(sha256=["0" * 64, "xyz"]), "'sha256'[1] is 'xyz', not a SHA-256 in hex"),
    (_meta_edit(generation=7), "names generation 7, but {path}/gen-7 does not exist"),
    (_meta_edit(ranks=1, bytes=[100], sha256=["0" * 64]), "{path}/gen-2/rank-0-of-1.pt is "
                                                          "missing"),
    (_meta_edit(bytes=[100, 100]), "{path}/gen-2/rank-0-of-2.pt has"),
    (_meta_edit(sha256=["0" * 64] * 2), "{path}/gen-2/rank-0-of-2.pt does not match its "
                                        "SHA-256"),
]


@pytest.mark.parametrize("damage,words", META_DAMAGE, ids=[d.__name__ for d, _ in META_DAMAGE])
def test_a_missing_or_edited_checkpoint_json_fails_and_generations_load_by_number(
        saved, damage, words):
    damage(saved)
    codec = PickleCodec()
    message = _fails_everywhere(saved, codec)
    for word in [words.format(path=saved), "generation 2 is intact: load(..., generation=2)"]:
        assert word in message, (word, message)
    if "checkpoint.json" in words or "not" in words:
        assert os.path.join(saved, META) in message, message
    assert codec.loaded == [], codec.loaded
    assert _loads_everywhere(saved, generation=2) == 2
    assert _loads_everywhere(saved, generation=1) == 1


def test_a_generation_by_number_needs_its_own_intact_metadata(saved):
    message = _fails_everywhere(saved, PickleCodec(), generation=7)
    assert f"generation 7: {saved}/gen-7 does not exist" in message, message
    assert "generation 2 is intact: load(..., generation=2) (also intact: 1)" in message
    own = os.path.join(saved, "gen-1", GENERATION_META)
    _edit_json(own, generation=2)
    message = _fails_everywhere(saved, PickleCodec(), generation=1)
    assert f"{own} records generation 2, not 1" in message, message
    os.remove(own)
    message = _fails_everywhere(saved, PickleCodec(), generation=1)
    assert f"{own} is missing" in message, message
    assert "generation 2 is intact" in message and "also" not in message, message
    for wrong in (0, "1", True, 1.0):
        message = _fails_everywhere(saved, PickleCodec(), generation=wrong)
        assert f"generation must be a positive integer or None, not {wrong!r}" in message
    assert _loads_everywhere(saved) == 2
    assert generations(saved) == [2]


# ---- the ranks agree ----

def test_damage_only_one_rank_sees_fails_on_every_rank_with_one_message(saved, tmp_path):
    """Rank 1 reads its own copy of the folder (as on a file system whose ranks see
    different bytes), with one byte of rank 0's part flipped: both ranks raise the same
    CheckpointError, naming rank 1 and its file; generation 1 then loads on both."""
    copy = str(tmp_path / "copy")
    shutil.copytree(saved, copy)
    file = _part(copy, rank=0)
    data = bytearray(_read(file))
    data[-3] ^= 0x01
    _write(file, bytes(data))

    def body(comm):
        mine = saved if comm.rank() == 0 else copy
        try:
            _load(comm, mine, PickleCodec())
        except CheckpointError as e:
            return str(e), _load(comm, mine, PickleCodec(), generation=1)
        raise AssertionError(f"rank {comm.rank()} loaded a checkpoint rank 1 found damaged")

    outcomes = _on_ranks(body)
    assert outcomes[0] == outcomes[1], outcomes
    message, step = outcomes[0]
    assert step == 1
    assert message.startswith(f"ringsync.checkpoint: {file} does not match its SHA-256"), message
    assert message.endswith("(on rank 1)"), message


@pytest.mark.parametrize("error,text", [
    (ValueError("this model does not fit"), "ringsync.checkpoint: the checkpoint does not "
                                            "load here: ValueError: this model does not fit"),
    (CheckpointError("ringsync.checkpoint: the saved model has no 'l3.weight'"),
     "ringsync.checkpoint: the saved model has no 'l3.weight'")], ids=["ValueError",
                                                                        "CheckpointError"])
def test_a_step_that_fails_on_one_rank_fails_on_every_rank(error, text):
    """What glue does with a checked Reader (copy it into a model) fails on rank 1 only:
    both ranks raise the same CheckpointError; when it works, each rank gets its value."""
    def body(comm):
        def apply():
            if comm.rank() == 1:
                raise error
            return "loaded"
        try:
            agreed(apply, comm)
        except CheckpointError as e:
            return str(e)
        raise AssertionError("returned normally while rank 1 failed")
    messages = _on_ranks(body)
    assert messages == [f"{text} (on rank 1)"] * 2, messages
    assert _on_ranks(lambda comm: agreed(lambda: comm.rank(), comm)) == [0, 1]


# ---- saves ----

def test_the_newest_two_complete_generations_stay_on_disk(tmp_path):
    path = str(tmp_path / "ckpt")
    codec = PickleCodec()

    def body(comm):
        kept = []
        for step in range(1, 5):
            _save(comm, path, step, codec)
            comm.barrier()
            kept.append(sorted(os.listdir(path)))
        return kept, _load(comm, path, codec), _load(comm, path, codec, generation=3)

    kept, latest, previous = _on_ranks(body)[0]
    assert kept == [[META, "gen-1"], [META, "gen-1", "gen-2"], [META, "gen-2", "gen-3"],
                    [META, "gen-3", "gen-4"]], kept
    assert (latest, previous) == (4, 3)
    assert generations(path) == [4, 3]


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(saved):
    """Rank 1's disk is full: every rank raises naming it, generation 2 stays the latest,
    and the next save (generation 4) removes the failed one and generation 1."""
    def full(target, data):
        raise OSError(28, "No space left on device")

    def body(comm):
        try:
            _save(comm, saved, 3, PickleCodec(), write=full if comm.rank() == 1 else None)
        except CheckpointError as e:
            message = str(e)
        else:
            raise AssertionError("a save with a full disk returned")
        step = _load(comm, saved, PickleCodec())
        return message, step, _save(comm, saved, 4, PickleCodec())

    outcomes = _on_ranks(body)
    assert outcomes[0] == outcomes[1], outcomes
    message, step, generation = outcomes[0]
    assert "rank 1 could not write its part: OSError: [Errno 28] No space" in message, message
    assert (step, generation) == (2, 4)
    assert sorted(os.listdir(saved)) == [META, "gen-2", "gen-4"], os.listdir(saved)


def test_rank_0_that_cannot_name_the_generation_fails_the_save_on_every_rank(saved):
    """Rank 0 cannot write checkpoint.json: no rank waits for it, every rank raises the
    same CheckpointError, and generation 2 stays the latest."""
    def no_metadata(target, data):
        if target.endswith(META):
            raise PermissionError(13, "Permission denied", target)
        _atomic(target, data)

    def body(comm):
        try:
            _save(comm, saved, 3, PickleCodec(), write=no_metadata)
        except CheckpointError as e:
            return str(e), _load(comm, saved, PickleCodec())
        raise AssertionError("a save that could not be named returned")

    outcomes = _on_ranks(body)
    assert outcomes[0] == outcomes[1], outcomes
    message, step = outcomes[0]
    assert f"rank 0 could not name generation 3 in {saved}: PermissionError" in message
    assert step == 2


def _atomic(target, data):
    from ringsync._atomic import write_atomically
    write_atomically(target, data)


class Killed(BaseException):
    """The process died here (not an Exception: nothing in save may catch it)."""


def _half_then_die(target, data):
    with open(temporary_path(target), "wb") as f:
        f.write(data[: len(data) // 2])
    raise Killed(target)


def _die(which, when):
    """A write that dies before or after writing the file whose name ends with `which`."""
    def write(target, data):
        if target.endswith(which) and when == "before":
            raise Killed(target)
        if target.endswith(which) and when == "half":
            _half_then_die(target, data)
        _atomic(target, data)
        if target.endswith(which):
            raise Killed(target)
    return write


# point of save: (how it dies there, the step of the latest named generation then, the
# generation kept beside the next save's: the newest complete one before it)
KILLS = {
    "before its part": (_die(".pt", "before"), 1, 1),
    "half way through its part": (_die(".pt", "half"), 1, 1),
    "after its part": (_die(".pt", "after"), 1, 1),
    "after every part, before meta.json": (_die(GENERATION_META, "before"), 1, 1),
    "after meta.json, before checkpoint.json": (_die(META, "before"), 1, 2),
    "half way through checkpoint.json": (_die(META, "half"), 1, 2),
    "after checkpoint.json, before removing generations": (_die(META, "after"), 2, 2),
}


@pytest.mark.parametrize("point", list(KILLS))
def test_a_save_stopped_at_any_point_leaves_the_latest_loadable(tmp_path, point):
    """A save on one rank is stopped at `point`: the latest named generation loads with
    its own values, and the next save works and keeps the newest complete one before it
    (a generation whose meta.json was written is complete, named or not)."""
    path = str(tmp_path / "ckpt")
    die, latest_step, kept = KILLS[point]

    def body(comm):
        _save(comm, path, 1, PickleCodec())
        with pytest.raises(Killed):
            _save(comm, path, 2, PickleCodec(), write=die)
        latest = _load(comm, path, PickleCodec())
        generation = _save(comm, path, 3, PickleCodec())
        return latest, generation, _load(comm, path, PickleCodec()), \
            _load(comm, path, PickleCodec(), generation=kept)

    latest, generation, after, previous = _on_ranks(body, size=1)[0]
    assert latest == latest_step, (point, latest)
    assert (generation, after, previous) == (3, 3, kept)
    assert generations(path) == [3, kept], (point, os.listdir(path))
    assert sorted(os.listdir(path)) == [META, f"gen-{kept}", "gen-3"], os.listdir(path)


def test_a_format_1_checkpoint_still_loads_with_its_sizes_checked(tmp_path):
    """Saved before checksums: no sha256, no meta.json, parts without their identity."""
    path = str(tmp_path / "old")
    os.makedirs(os.path.join(path, "gen-4"))
    sizes = []
    for rank, (lo, hi) in enumerate([(0, 11), (11, 23)]):
        part = {"format": 1, "pieces": {"w": [{"a": lo, "b": hi, "total": N,
                                               "tensor": _values(3)[lo:hi]}]},
                "whole": {"extra": {"step": 3}} if rank == 0 else {}}
        data = pickle.dumps(part)
        _write(_part(path, generation=4, rank=rank), data)
        sizes.append(len(data))
    meta = {"format": 1, "generation": 4, "ranks": 2, "bytes": sizes}
    _write(os.path.join(path, META), json.dumps(meta).encode())
    assert _loads_everywhere(path) == 3
    _edit_json(os.path.join(path, META), bytes=[sizes[0], sizes[1] + 1])
    message = _fails_everywhere(path, PickleCodec())
    assert f"{_part(path, generation=4, rank=1)} has {sizes[1]} bytes" in message, message
    assert f"no intact generation in {path}" in message, message
