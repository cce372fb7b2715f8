"""Sharded checkpoints: every rank writes its own part, and a checkpoint saved on N ranks
loads on M (PyTorch models and optimizers).

    ringsync.checkpoint.save(path, model, optimizer, step=step)
    extra = ringsync.checkpoint.load(path, model, optimizer)   # {"step": step}

`path` is a directory every rank of the set can reach (a shared file system across hosts).
A save writes generation k:

    path/gen-<k>/rank-<r>-of-<N>.pt    each rank's part: its slices of sharded tensors,
                                        rank 0's also the replicated state and `extra`
    path/checkpoint.json               written last, by rank 0: names generation k

Every file is written to a temporary name, flushed to disk (fsync) and renamed into place,
and checkpoint.json only after every rank's part is on disk; so a crash or a killed rank at
any point leaves checkpoint.json naming the previous complete generation, and a load never
sees a half-written checkpoint. Older generations are removed after the new one is named.

What each part holds:
- a ShardedModule (stage 3): this rank's slice of every module's run, with the elements
  [lo, hi) it covers; buffers from rank 0. A plain torch.nn.Module: its state_dict, from
  rank 0 (every rank holds the same).
- a ShardedOptimizer (stages 1, 2) or an optimizer over a ShardedModule's slices: the
  per-element state (momentum, exp_avg, ...) and master copies as slices with their element
  ranges, the per-tensor state (Adam's step) and hyperparameters; any other optimizer
  (DistributedOptimizer, plain torch): its state_dict, from rank 0.
A load assembles the element ranges its own ranks need from every saved part, so the rank
count may change between save and load; the model's structure and the optimizer's param
groups may not. Loading a ShardedModule checkpoint into a plain module (or the reverse)
works as well. Files are read with torch.load(weights_only=True): a checkpoint cannot run
code.
"""
import json
import os
import re
import shutil

from ringsync.errors import CheckpointError, UsageError
from ringsync.process_sets import global_process_set

FORMAT = 1
META = "checkpoint.json"
_GENERATION = re.compile(r"gen-(\d+)$")


# ---- the parts a rank writes ----

class Parts:
    """What one rank saves: slices of flat tensors ("pieces", with the element range
    [a, b) of `total` they cover) and whole values, both under string keys."""

    def __init__(self):
        self.pieces, self.whole = {}, {}

    def add_piece(self, key, tensor, a, total):
        """Elements [a, a + tensor.numel()) of the flat tensor `key` of `total` elements (a
        rank may add several pieces of one key)."""
        flat = tensor.detach().reshape(-1).cpu().clone()
        self.pieces.setdefault(key, []).append(
            {"a": int(a), "b": int(a) + flat.numel(), "total": int(total), "tensor": flat})

    def as_dict(self):
        return {"format": FORMAT, "pieces": self.pieces, "whole": self.whole}


class Reader:
    """Every saved part of one generation, assembled by key and element range."""

    def __init__(self, files):
        import torch
        self.parts = []
        for f in files:
            try:
                self.parts.append(torch.load(f, map_location="cpu", weights_only=True,
                                             mmap=True))
            except Exception as e:  # (any torch or pickle failure: name the file)
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
        import torch
        found = self.total(key)
        if found != total:
            raise CheckpointError(f"ringsync.checkpoint: '{key}' has {found} elements in the "
                                  f"checkpoint, {total} here")
        out, covered = None, []
        for piece in self._pieces(key):
            t, pa, pb = piece["tensor"], piece["a"], piece["b"]
            if not (0 <= pa <= pb <= total and t.numel() == pb - pa):
                raise CheckpointError(f"ringsync.checkpoint: '{key}' has a piece [{pa}, {pb}) "
                                      f"of {t.numel()} elements, out of [0, {total})")
            out = torch.empty(b - a, dtype=t.dtype) if out is None else out
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

def save(path, model, optimizer=None, process_set=global_process_set, **extra):
    """Save model (and optimizer) to directory `path`; every rank of the set calls it.
    extra: picklable values of plain types (numbers, strings, lists, dicts, tensors),
    returned by load(). Returns the generation number written."""
    import ringsync as rs
    comm = rs._comm(process_set)
    rank, size = comm.rank(), comm.size()
    parts = Parts()
    _save_module(model, parts, rank)
    if optimizer is not None:
        _save_optimizer(optimizer, parts, rank)
    if rank == 0:
        parts.whole["extra"] = extra
    generation = rs.allgather_object(_next_generation(path) if rank == 0 else None,
                                     name="ringsync.checkpoint.generation",
                                     process_set=process_set)[0]
    folder = os.path.join(path, f"gen-{generation}")
    outcome = _write_part(folder, rank, size, parts)
    outcomes = rs.allgather_object(outcome, name="ringsync.checkpoint.written",
                                   process_set=process_set)
    failed = [(r, o) for r, o in enumerate(outcomes) if isinstance(o, str)]
    if failed:
        raise CheckpointError("ringsync.checkpoint.save: " + "; ".join(
            f"rank {r} could not write its part: {why}" for r, why in failed))
    if rank == 0:
        meta = {"format": FORMAT, "generation": generation, "ranks": size,
                "bytes": outcomes}
        _write_atomically(os.path.join(path, META), json.dumps(meta).encode())
        _remove_other_generations(path, generation)
    rs.barrier(process_set)  # (returns once the checkpoint is named, on every rank)
    return generation


def _next_generation(path):
    os.makedirs(path, exist_ok=True)
    seen = [int(m.group(1)) for m in map(_GENERATION.match, os.listdir(path)) if m]
    return max(seen, default=0) + 1


def _write_part(folder, rank, size, parts):
    """The part's size in bytes, or why it could not be written."""
    import io

    import torch
    try:
        os.makedirs(folder, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(parts.as_dict(), buffer)
        data = buffer.getvalue()
        _write_atomically(os.path.join(folder, _part_name(rank, size)), data)
        return len(data)
    except Exception as e:  # (disk full, an unpicklable extra: every rank must hear of it)
        return f"{type(e).__name__}: {e}"


def _part_name(rank, size):
    return f"rank-{rank}-of-{size}.pt"


def _write_atomically(path, data):
    """Write data to a temporary name, fsync it, rename it to path, fsync the folder: path
    then holds either its old content or all of data, whatever happens meanwhile."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _remove_other_generations(path, keep):
    for entry in os.listdir(path):
        m = _GENERATION.match(entry)
        if m and int(m.group(1)) != keep:
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


# ---- load ----

def load(path, model, optimizer=None, process_set=global_process_set):
    """Load the newest complete checkpoint in `path` into model (and optimizer), whatever
    the number of ranks it was saved on; returns the `extra` values save() was given.
    Every rank of the set calls it."""
    reader = open_checkpoint(path)
    _load_module(model, reader)
    if optimizer is not None:
        _load_optimizer(optimizer, reader)
    return reader.whole("extra")


def open_checkpoint(path):
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
    return Reader(files)


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


# ---- models ----

def _save_module(model, parts, rank):
    from ringsync.torch.sharded_module import ShardedModule
    if isinstance(model, ShardedModule):
        model.save_parts(parts, rank)
    elif rank == 0:
        parts.whole["model.state"] = model.state_dict()


def _load_module(model, reader):
    from ringsync.torch.sharded_module import ShardedModule, load_units_into_plain
    sharded_saved = reader.has_whole("model.layout")
    if isinstance(model, ShardedModule):
        if sharded_saved:
            model.load_parts(reader)
        else:
            model.load_full_state(reader.whole("model.state"))
    elif sharded_saved:
        load_units_into_plain(model, reader)
    else:
        model.load_state_dict(reader.whole("model.state"))


# ---- optimizers ----

def _save_optimizer(optimizer, parts, rank):
    save_parts = getattr(optimizer, "save_parts", None)
    if save_parts is not None:
        save_parts(parts, rank)
    elif _over_slices(optimizer):
        from ringsync.torch.sharded_module import save_slice_state
        save_slice_state(optimizer, parts, rank)
    elif rank == 0:
        parts.whole["optimizer.state"] = optimizer.state_dict()


def _load_optimizer(optimizer, reader):
    load_parts = getattr(optimizer, "load_parts", None)
    if load_parts is not None:
        load_parts(reader)
    elif _over_slices(optimizer):
        from ringsync.torch.sharded_module import load_slice_state
        load_slice_state(optimizer, reader)
    else:
        optimizer.load_state_dict(reader.whole("optimizer.state"))


def _over_slices(optimizer):
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return bool(params) and all(hasattr(p, "_ringsync_unit") for p in params)
