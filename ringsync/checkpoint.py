"""Sharded checkpoints, the format: every rank writes its own part, and a checkpoint saved
on N ranks loads on M. Framework-free: a framework's glue (ringsync.torch.checkpoint for
PyTorch models and optimizers) says what goes into the parts, and supplies a Codec (how its
tensors are copied, made, written and read).

`path` is a directory every rank of the set can reach (a shared file system across hosts).
A save writes generation k:

    path/gen-<k>/rank-<r>-of-<N>.pt    each rank's part: its slices of sharded tensors,
                                        rank 0's also the replicated state and `extra`
    path/checkpoint.json               written last, by rank 0: names generation k

Every file is written to a temporary name, flushed to disk (fsync) and renamed into place,
and checkpoint.json only after every rank's part is on disk; so a crash or a killed rank at
any point leaves checkpoint.json naming the previous complete generation, and a load never
sees a half-written checkpoint. Older generations are removed after the new one is named.

A part holds slices of flat tensors ("pieces", each with the element range [a, b) of the
whole it covers) and whole values, under string keys. A load assembles the element ranges
its own ranks need from every saved part (Reader.range), so the rank count may change
between save and load.
"""
import abc
import json
import os
import re
import shutil

from ringsync._atomic import write_atomically
from ringsync.errors import CheckpointError
from ringsync.objects import allgather_object

__all__ = ["FORMAT", "META", "CheckpointError", "Codec", "Parts", "Reader", "open_checkpoint",
           "save_generation", "write_atomically"]

FORMAT = 1
META = "checkpoint.json"
_GENERATION = re.compile(r"gen-(\d+)$")
_MOVED = {"save": "ringsync.torch.checkpoint.save", "load": "ringsync.torch.checkpoint.load"}


def __getattr__(name):
    if name in _MOVED:  # (PyTorch's entry points live with the PyTorch glue)
        raise AttributeError(f"module 'ringsync.checkpoint' has no attribute '{name}': "
                             f"PyTorch models and optimizers are saved with {_MOVED[name]}")
    raise AttributeError(f"module 'ringsync.checkpoint' has no attribute '{name}'")


class Codec(abc.ABC):
    """What the format needs from a framework: its tensors flat on the host, new ones, and
    a part's bytes. A part is a dict of plain values and the framework's tensors."""

    @abc.abstractmethod
    def flat_copy(self, tensor):
        """A one-dimensional host copy of tensor (whatever its shape or device)."""

    @abc.abstractmethod
    def numel(self, tensor) -> int:
        """The number of elements of tensor."""

    @abc.abstractmethod
    def empty(self, n: int, like):
        """A one-dimensional host tensor of n elements of like's dtype."""

    @abc.abstractmethod
    def dumps(self, part: dict) -> bytes:
        """part as bytes (may raise: a value that cannot be saved)."""

    @abc.abstractmethod
    def load(self, file: str) -> dict:
        """What dumps wrote to file (may raise anything: the file is named unreadable)."""


# ---- the parts a rank writes ----

class Parts:
    """What one rank saves: slices of flat tensors ("pieces", with the element range
    [a, b) of `total` they cover) and whole values, both under string keys."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.pieces, self.whole = {}, {}

    def add_piece(self, key, tensor, a, total):
        """Elements [a, a + numel(tensor)) of the flat tensor `key` of `total` elements (a
        rank may add several pieces of one key)."""
        flat = self.codec.flat_copy(tensor)
        self.pieces.setdefault(key, []).append(
            {"a": int(a), "b": int(a) + self.codec.numel(flat), "total": int(total),
             "tensor": flat})

    def as_dict(self):
        return {"format": FORMAT, "pieces": self.pieces, "whole": self.whole}


class Reader:
    """Every saved part of one generation, assembled by key and element range."""

    def __init__(self, files, codec: Codec):
        self.codec = codec
        self.parts = []
        for f in files:
            try:
                self.parts.append(codec.load(f))
            except Exception as e:  # (any framework or pickle failure: name the file)
                raise CheckpointError(f"ringsync.checkpoint: {f} cannot be read ({e})") from e
        for f, part in zip(files, self.parts):
            if not isinstance(part, dict) or part.get("format") != FORMAT:
                raise CheckpointError(f"ringsync.checkpoint: {f} is not a ringsync checkpoint "
                                      f"part of format {FORMAT}")

    def has_whole(self, key):
        return any(key in p["whole"] for p in self.parts)

    def whole(self, key):
        for part in self.parts:
            if key in part["whole"]:
                return part["whole"][key]
        raise CheckpointError(f"ringsync.checkpoint: the checkpoint has no '{key}'")

    def _pieces(self, key):
        return [piece for part in self.parts for piece in part["pieces"].get(key, ())]

    def total(self, key):
        totals = {piece["total"] for piece in self._pieces(key)}
        if len(totals) != 1:
            raise CheckpointError(f"ringsync.checkpoint: '{key}' has no single size in the "
                                  f"checkpoint (sizes found: {sorted(totals)})")
        return totals.pop()

    def range(self, key, a, b, total):
        """Elements [a, b) of the flat tensor `key` (of `total` elements), from whichever
        parts hold them; CheckpointError when the sizes differ or elements are missing."""
        found = self.total(key)
        if found != total:
            raise CheckpointError(f"ringsync.checkpoint: '{key}' has {found} elements in the "
                                  f"checkpoint, {total} here")
        out, covered = None, []
        for piece in self._pieces(key):
            t, pa, pb = piece["tensor"], piece["a"], piece["b"]
            if not (0 <= pa <= pb <= total and self.codec.numel(t) == pb - pa):
                raise CheckpointError(f"ringsync.checkpoint: '{key}' has a piece [{pa}, {pb}) "
                                      f"of {self.codec.numel(t)} elements, out of [0, {total})")
            out = self.codec.empty(b - a, t) if out is None else out
            lo, hi = max(a, pa), min(b, pb)
            if lo < hi:
                out[lo - a: hi - a] = t[lo - pa: hi - pa]
                covered.append((lo, hi))
        missing = _gaps(sorted(covered), a, b)
        if missing:
            raise CheckpointError(f"ringsync.checkpoint: elements {missing[:3]} of '{key}' are "
                                  "in no saved part")
        return out


def _gaps(spans, a, b):
    gaps, at = [], a
    for lo, hi in spans:
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < b:
        gaps.append((at, b))
    return gaps


# ---- save ----

def save_generation(path, parts: Parts, comm, process_set, write=None):
    """Write this rank's parts as the next generation in `path`, and (rank 0) name it in
    checkpoint.json once every rank's part is on disk; every rank of the set calls it.
    comm: the set's communicator (its rank, size and barrier); process_set: what the
    object exchanges run over. write: how a file is written (write_atomically). Returns
    the generation number written; CheckpointError on every rank if a rank could not
    write its part."""
    write = write_atomically if write is None else write
    rank, size = comm.rank(), comm.size()
    generation = allgather_object(_next_generation(path) if rank == 0 else None,
                                  name="ringsync.checkpoint.generation",
                                  process_set=process_set)[0]
    folder = os.path.join(path, f"gen-{generation}")
    outcome = _write_part(folder, rank, size, parts, write)
    outcomes = allgather_object(outcome, name="ringsync.checkpoint.written",
                                process_set=process_set)
    failed = [(r, o) for r, o in enumerate(outcomes) if isinstance(o, str)]
    if failed:
        raise CheckpointError("ringsync.checkpoint.save: " + "; ".join(
            f"rank {r} could not write its part: {why}" for r, why in failed))
    if rank == 0:
        meta = {"format": FORMAT, "generation": generation, "ranks": size,
                "bytes": outcomes}
        write(os.path.join(path, META), json.dumps(meta).encode())
        _remove_other_generations(path, generation)
    comm.barrier()  # (returns once the checkpoint is named, on every rank)
    return generation


def _next_generation(path):
    os.makedirs(path, exist_ok=True)
    seen = [int(m.group(1)) for m in map(_GENERATION.match, os.listdir(path)) if m]
    return max(seen, default=0) + 1


def _write_part(folder, rank, size, parts, write):
    """The part's size in bytes, or why it could not be written."""
    try:
        os.makedirs(folder, exist_ok=True)
        data = parts.codec.dumps(parts.as_dict())
        write(os.path.join(folder, _part_name(rank, size)), data)
        return len(data)
    except Exception as e:  # (disk full, an unpicklable extra: every rank must hear of it)
        return f"{type(e).__name__}: {e}"


def _part_name(rank, size):
    return f"rank-{rank}-of-{size}.pt"


def _remove_other_generations(path, keep):
    for entry in os.listdir(path):
        m = _GENERATION.match(entry)
        if m and int(m.group(1)) != keep:
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


# ---- load ----

def open_checkpoint(path, codec: Codec):
    """A Reader over the generation checkpoint.json names (CheckpointError if none)."""
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"ringsync.checkpoint: no checkpoint in {path} ({META} is "
                              "missing)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"ringsync.checkpoint: {meta_path} cannot be read ({e})") from e
    generation, ranks, sizes = _check_meta(meta, meta_path)
    folder = os.path.join(path, f"gen-{generation}")
    files = [os.path.join(folder, _part_name(r, ranks)) for r in range(ranks)]
    for f, expected in zip(files, sizes):
        try:
            found = os.path.getsize(f)
        except OSError as e:
            raise CheckpointError(f"ringsync.checkpoint: {f} is missing ({e})") from e
        if found != expected:
            raise CheckpointError(f"ringsync.checkpoint: {f} has {found} bytes, {meta_path} "
                                  f"says {expected}")
    return Reader(files, codec)


def _check_meta(meta, where):
    ok = isinstance(meta, dict) and meta.get("format") == FORMAT
    generation, ranks, sizes = (meta.get(k) for k in ("generation", "ranks", "bytes")) \
        if ok else (None, None, None)
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                    for v in (generation, ranks)) and ranks <= 1 << 20 and \
        isinstance(sizes, list) and len(sizes) == ranks and \
        all(isinstance(s, int) and s > 0 for s in sizes)
    if not ok:
        raise CheckpointError(f"ringsync.checkpoint: {where} is not a ringsync checkpoint of "
                              f"format {FORMAT}: {str(meta)[:200]}")
    return generation, ranks, sizes
