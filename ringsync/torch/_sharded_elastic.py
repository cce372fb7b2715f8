"""Elastic snapshots of sharded training for TorchState (ringsync.torch.elastic): a
ShardedModule's slices and a ShardedOptimizer's pieces exist once across the ranks, so a
commit keeps each rank's own part of them — the part a checkpoint would write
(ringsync.torch.checkpoint), held in memory — and, with ShardedOptimizer(redundancy=1),
a copy of its left neighbour's part (rank r holds rank r-1's, sent at the commit).

After a lost rank the survivors put the committed state together from their own parts and
the lost ranks' copies (held by each lost rank's right neighbour), lay the model and the
optimizer out over the new ring and load it: training rolls back to the commit and goes
on, with no checkpoint on disk. A rank lost together with the neighbour that held its copy
(or any lost rank without redundancy) cannot be rebuilt: every survivor raises the same
error instead of going on with wrong numbers.
"""
import copy
import io

import torch

from ringsync._context import resolve
from ringsync.errors import RingsyncError
from ringsync.objects import allgather_object

from ringsync.checkpoint import Parts, Reader

from . import mpi_ops
from .checkpoint import CODEC, _load_module, _load_optimizer, _save_module, _save_optimizer

REPLICATED = "model.state"  # (a plain module's whole state_dict: every rank holds it)


class ShardedStateLost(RingsyncError):
    """A lost rank's part of the sharded state is on no survivor."""


def holds_shards(model, optimizer) -> bool:
    """Whether TorchState must keep per-rank parts (a ShardedModule, a ShardedOptimizer)."""
    from .sharded import ShardedOptimizer
    from .sharded_module import ShardedModule
    return isinstance(model, ShardedModule) or isinstance(optimizer, ShardedOptimizer)


def snapshot(model, optimizer):
    """This rank's part of the live state (copies), and its left neighbour's with
    redundancy. Every rank of the job calls it (the copy moves at the call)."""
    comm = resolve()
    parts = Parts(CODEC)
    # (saved as rank 0 saves: the layouts and hyperparameters go into every part)
    if model is not None:
        _save_module(model, parts, 0)
    if optimizer is not None:
        _save_optimizer(optimizer, parts, 0)
    own = parts.as_dict(0, comm.rank(), comm.size())
    own["whole"] = {k: _copied(v) for k, v in own["whole"].items()}
    left = None
    if getattr(optimizer, "redundancy", 0) and comm.size() > 1:
        left = _pass_right(_shared_part(own), comm)
    return {"rank": comm.rank(), "size": comm.size(), "own": own, "left": left}


def restore(snap, model, optimizer):
    """Load a snapshot; where the ring changed since (a lost rank), first put the
    committed state together from every survivor's parts and copies and lay the model and
    optimizer out over the new ring. Every rank of the job calls it."""
    comm = resolve()
    who = allgather_object((snap["rank"], snap["size"]),
                           name="ringsync.elastic.sharded.who")
    if who == [(r, comm.size()) for r in range(comm.size())]:
        reader = Reader([snap["own"]], CODEC, 0)  # (the same ring: this rank's own part)
    else:
        reader = Reader(_gather_parts(snap, who), CODEC, 0)
        _lay_out_again(model, optimizer)
    if model is not None:
        _load_module(model, reader)
    if optimizer is not None:
        _load_optimizer(optimizer, reader)


def _gather_parts(snap, who):
    """Every part the new ring needs, on every rank: its own part whole, the others'
    shared pieces, and the copies of the lost ranks' (briefly the whole sharded state)."""
    old_size = snap["size"]
    if any(size != old_size for _, size in who):
        raise ShardedStateLost(f"ringsync.elastic: the survivors' snapshots come from rings "
                               f"of different sizes ({who}); sharded state cannot be put "
                               "together (replacement ranks are not supported with it)")
    alive = {rank for rank, _ in who}
    lost = sorted(set(range(old_size)) - alive)
    if lost and snap["left"] is None:  # (redundancy is the same on every rank)
        raise ShardedStateLost(
            f"ringsync.elastic: the part of the sharded state of rank(s) {lost} is gone: "
            "ShardedOptimizer(..., redundancy=1) keeps a copy of each rank's part on its "
            "neighbour; without it a lost rank cannot be recovered in place")
    for rank in lost:
        holder = (rank + 1) % old_size
        if holder not in alive:
            raise ShardedStateLost(
                f"ringsync.elastic: rank {rank}'s part of the sharded state (of {old_size} "
                f"ranks) is gone: its copy was on rank {holder}, lost as well before a commit "
                f"could copy it again (lost: {lost}); restart from a checkpoint")
    mine = [_shared_part(snap["own"])]
    left = (snap["rank"] - 1) % old_size
    if left in lost:
        mine.append(snap["left"])
    everyone = allgather_object(mine, name="ringsync.elastic.sharded.parts")
    return [snap["own"]] + [part for parts in everyone for part in parts]


def _lay_out_again(model, optimizer):
    """The model's slices and the optimizer's pieces, laid out over the ring as it is now
    (their values are loaded next)."""
    from .sharded import ShardedOptimizer
    from .sharded_module import ShardedModule
    renamed = model.lay_out_again() if isinstance(model, ShardedModule) else {}
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.lay_out_again(renamed)


def _shared_part(part):
    """A part without the replicated model state (every survivor holds its own)."""
    return {**part, "whole": {k: v for k, v in part["whole"].items() if k != REPLICATED}}


def _pass_right(part, comm):
    """Send `part` to the next rank of the ring and receive the previous rank's: first
    its layout and whole values (pickled, small), then its pieces laid end to end, one
    message per dtype (no pickled copy of the bulk, and a handful of messages whatever
    the number of pieces). Unnamed messages between two ranks match in order."""
    me, size = comm.rank(), comm.size()
    right, left = (me + 1) % size, (me - 1) % size  # (the ring's own numbering, as send's)
    pieces = [(key, piece) for key, entries in part["pieces"].items() for piece in entries]
    layout = {"pieces": [(key, {k: v for k, v in piece.items() if k != "tensor"},
                          piece["tensor"].dtype) for key, piece in pieces],
              "whole": part["whole"],
              "rest": {k: v for k, v in part.items() if k not in ("pieces", "whole")}}
    mine = _pickled(layout)
    theirs = _exchange_bytes(mine, right, left, most=4 * mine.numel() + (1 << 20))
    sending, sizes = {}, {}  # dtype -> my pieces, in order; dtype -> elements coming
    for _, piece in pieces:
        sending.setdefault(piece["tensor"].dtype, []).append(piece["tensor"])
    for _, fields, dtype in _checked_layout(theirs, left):
        sizes[dtype] = sizes.get(dtype, 0) + fields["b"] - fields["a"]
    own = sum(piece["tensor"].numel() * piece["tensor"].element_size() for _, piece in pieces)
    coming = sum(n * torch.empty(0, dtype=d).element_size() for d, n in sizes.items())
    if coming > 2 * own + (1 << 20):  # (neighbours' parts differ by an element per bucket)
        raise RingsyncError(f"ringsync.elastic: rank {left} announces {coming} bytes of "
                                 f"sharded state to copy, this rank holds {own}: refused")
    receiving = {dtype: torch.empty(n, dtype=dtype) for dtype, n in sizes.items()}
    handles = [mpi_ops.send_async(torch.cat(group), right) for group in sending.values()]
    handles += [mpi_ops.recv_async(flat, left) for flat in receiving.values()]
    for handle in handles:
        mpi_ops.synchronize(handle)
    received, at = {}, dict.fromkeys(sizes, 0)
    for key, fields, dtype in theirs["pieces"]:  # (each piece a view of its dtype's buffer)
        n = fields["b"] - fields["a"]
        received.setdefault(key, []).append(
            dict(fields, tensor=receiving[dtype][at[dtype]: at[dtype] + n]))
        at[dtype] += n
    return dict(theirs["rest"], pieces=received, whole=theirs["whole"])


def _pickled(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def _exchange_bytes(data, right, left, most):
    """Send data (uint8) right, receive the left rank's (at most `most` bytes), unpickled
    (weights_only: plain values and tensors, nothing that runs code)."""
    theirs = torch.empty(1, dtype=torch.int64)
    _exchange(torch.tensor([data.numel()], dtype=torch.int64), right, theirs, left)
    length = int(theirs.item())
    if not 0 < length <= most:
        raise RingsyncError(f"ringsync.elastic: rank {left} announces a {length}-byte "
                                 f"layout of its sharded state (at most {most} expected)")
    received = torch.empty(length, dtype=torch.uint8)
    _exchange(data, right, received, left)
    return torch.load(io.BytesIO(received.numpy().tobytes()), weights_only=True)


def _checked_layout(theirs, left):
    """The pieces a peer announces, each an element range inside its tensor's size, of a
    torch dtype (RingsyncError naming the peer and the entry otherwise: not a lost rank,
    which recovery would answer by rebuilding the same ring)."""
    entries = theirs.get("pieces") if isinstance(theirs, dict) else None
    for entry in entries if isinstance(entries, list) else [None]:
        fine = isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[1], dict) \
            and isinstance(entry[2], torch.dtype) and \
            all(isinstance(entry[1].get(k), int) for k in ("a", "b", "total")) and \
            0 <= entry[1]["a"] <= entry[1]["b"] <= entry[1]["total"]
        if not fine:
            raise RingsyncError(f"ringsync.elastic: rank {left} sent a malformed layout "
                                     f"of its sharded state (entry {str(entry)[:200]})")
    return entries


def _exchange(send, right, recv, left):
    handles = [mpi_ops.send_async(send, right), mpi_ops.recv_async(recv, left)]
    for handle in handles:
        mpi_ops.synchronize(handle)


def _copied(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return copy.deepcopy(value)
