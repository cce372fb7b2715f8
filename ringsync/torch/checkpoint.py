"""Sharded checkpoints of PyTorch models and optimizers: every rank writes its own part,
and a checkpoint saved on N ranks loads on M (the format: ringsync.checkpoint).

    import ringsync.torch.checkpoint
    ringsync.torch.checkpoint.save(path, model, optimizer, step=step)
    extra = ringsync.torch.checkpoint.load(path, model, optimizer)   # {"step": step}

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
code. Every part's size and SHA-256 are checked first; a damaged checkpoint raises the same
CheckpointError on every rank, and the previous generation stays loadable:

    ringsync.torch.checkpoint.load(path, model, optimizer, generation=k - 1)
"""
import copy
import io

import torch

from ringsync.checkpoint import META, CheckpointError, Codec, Parts, agreed, generations, \
    open_checkpoint, save_generation
from ringsync.checkpoint import write_atomically as _write_atomically
from ringsync._context import resolve
from ringsync.process_sets import global_process_set

from .sharded_module import ShardedModule, load_buffers

__all__ = ["META", "CheckpointError", "TorchCodec", "generations", "save", "load",
           "save_slice_state",
           "load_slice_state", "load_units_into_plain"]


class TorchCodec(Codec):
    """PyTorch tensors in a checkpoint's parts: written with torch.save, read with
    torch.load(weights_only=True) (a part cannot run code), memory-mapped."""

    def flat_copy(self, tensor):
        return tensor.detach().reshape(-1).cpu().clone()

    def numel(self, tensor):
        return tensor.numel()

    def empty(self, n, like):
        return torch.empty(n, dtype=like.dtype)

    def dumps(self, part):
        buffer = io.BytesIO()
        torch.save(part, buffer)
        return buffer.getvalue()

    def load(self, file):
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)


CODEC = TorchCodec()


# ---- save and load ----

def save(path, model, optimizer=None, process_set=global_process_set, **extra):
    """Save model (and optimizer) to directory `path`; every rank of the set calls it.
    extra: picklable values of plain types (numbers, strings, lists, dicts, tensors),
    returned by load(). Returns the generation number written."""
    comm = resolve(process_set)
    rank = comm.rank()
    parts = Parts(CODEC)
    _save_module(model, parts, rank)
    if optimizer is not None:
        _save_optimizer(optimizer, parts, rank)
    if rank == 0:
        parts.whole["extra"] = extra
    # (written through this module's name for the atomic write, which tests replace)
    return save_generation(path, parts, comm, process_set, write=_write_atomically)


def load(path, model, optimizer=None, process_set=global_process_set, *, generation=None):
    """Load a checkpoint in `path` into model (and optimizer), whatever the number of ranks
    it was saved on; returns the `extra` values save() was given. generation: the one to
    load (None: the newest, which checkpoint.json names; the previous complete one stays
    on disk, see generations(path)). Every rank of the set calls it. Every part's size and
    SHA-256 is checked before anything is read from it; if any rank finds a problem (a
    damaged part, a model that does not fit), every rank raises the same CheckpointError,
    naming the file and which generations are intact."""
    reader = open_checkpoint(path, CODEC, process_set, generation=generation)

    def apply():
        _load_module(model, reader)
        if optimizer is not None:
            _load_optimizer(optimizer, reader)
        return reader.whole("extra")

    return agreed(apply, process_set)


# ---- models ----

def _save_module(model, parts, rank):
    if isinstance(model, ShardedModule):
        model.save_parts(parts, rank)
    elif rank == 0:
        parts.whole["model.state"] = model.state_dict()


def _load_module(model, reader):
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


def load_units_into_plain(model, reader):
    """A ShardedModule checkpoint into the plain module it wrapped: every run whole."""
    with torch.no_grad():
        for entry in reader.whole("model.layout"):
            sub = model.get_submodule(entry["path"])
            total = sum(_numel(shape) for shape in entry["shapes"])
            key = f"model.{entry['path']}:{','.join(entry['names'])}"
            flat, at = reader.range(key, 0, total, total), 0
            for name, shape in zip(entry["names"], entry["shapes"]):
                getattr(sub, name).copy_(flat[at: at + _numel(shape)].view(shape))
                at += _numel(shape)
    load_buffers(model, reader.whole("model.buffers"))


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ---- optimizers ----

def _save_optimizer(optimizer, parts, rank):
    save_parts = getattr(optimizer, "save_parts", None)
    if save_parts is not None:
        save_parts(parts, rank)
    elif _over_slices(optimizer):
        save_slice_state(optimizer, parts, rank)
    elif rank == 0:
        parts.whole["optimizer.state"] = optimizer.state_dict()


def _load_optimizer(optimizer, reader):
    load_parts = getattr(optimizer, "load_parts", None)
    if load_parts is not None:
        load_parts(reader)
    elif _over_slices(optimizer):
        load_slice_state(optimizer, reader)
    else:
        optimizer.load_state_dict(reader.whole("optimizer.state"))


def _over_slices(optimizer):
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return bool(params) and all(hasattr(p, "_ringsync_unit") for p in params)


def save_slice_state(optimizer, parts, rank):
    """The state of an optimizer over ShardedModule slices: per-element entries as slices,
    per-tensor ones (Adam's step) whole; rank 0 adds the groups' hyperparameters."""
    kinds = {}
    for p in _slices(optimizer):
        u = p._ringsync_unit
        for k, v in optimizer.state.get(p, {}).items():
            key = f"optimizer.{u.key}.{k}"
            if torch.is_tensor(v) and v.shape == p.shape:
                parts.add_piece(key, v, u.lo, u.numel)
                kinds.setdefault(u.key, {})[k] = "piece"
            else:
                parts.whole[key] = v.detach().cpu().clone() if torch.is_tensor(v) else v
                kinds.setdefault(u.key, {})[k] = "whole"
    parts.whole["optimizer.kinds"] = kinds
    if rank == 0:
        parts.whole["optimizer.groups"] = _groups(optimizer)


def load_slice_state(optimizer, reader):
    """The state of an optimizer over ShardedModule slices, from a checkpoint saved on any
    number of ranks (save_slice_state's)."""
    saved, mine = reader.whole("optimizer.groups"), _groups(optimizer)
    if [g["units"] for g in saved] != [g["units"] for g in mine]:
        raise CheckpointError("ringsync.checkpoint: the optimizer's param groups differ from "
                              f"the saved ones: saved {[g['units'] for g in saved]}, here "
                              f"{[g['units'] for g in mine]}")
    kinds = reader.whole("optimizer.kinds")
    state = {}
    for i, p in enumerate(_slices(optimizer)):
        u = p._ringsync_unit
        entry = {}
        for k, kind in kinds.get(u.key, {}).items():
            key = f"optimizer.{u.key}.{k}"
            entry[k] = reader.range(key, u.lo, u.hi, u.numel) if kind == "piece" else \
                copy.deepcopy(reader.whole(key))  # (never shared: optimizers update in place)
        if entry:
            state[i] = entry
    at, groups = 0, []
    for g in saved:
        groups.append(dict(g["hyper"], params=list(range(at, at + len(g["units"])))))
        at += len(g["units"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _slices(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def _groups(optimizer):
    return [{"hyper": {k: v for k, v in g.items() if k != "params"},
             "units": [p._ringsync_unit.key for p in g["params"]]}
            for g in optimizer.param_groups]
