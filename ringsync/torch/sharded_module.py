"""ShardedModule: ZeRO stage 3 for PyTorch — parameters stored sharded over a process set.

Each submodule that owns parameters directly (a Linear, a custom module with its own
weights) has them laid end to end in one flat run per dtype and trainability (a "unit");
every rank of the set keeps one contiguous slice of it (split as even_split splits), as a
torch.nn.Parameter of the ShardedModule. The submodule's own attributes (weight, bias) are removed and, only while
it runs, set to views of the gathered run:

- forward: a pre-hook allgathers the unit's run (in the compute dtype), the forward runs on
  views of it, a post-hook drops the views. Tensors autograd saves for backward that are
  views of a gathered run are not kept: a saved-tensor hook records where they lie and
  gathers the run again when backward needs them (Linear saves its weight, say).
- backward: the gathered run's gradient is reduce-scattered (averaged over the set, as
  DistributedOptimizer's op=Average) straight into the gradient of this rank's slice.

- prefetch: from the second pass on, the gather of the unit that ran next in the first
  pass (forward order in forward, backward's own order in backward) starts as a unit
  begins, so it moves while this unit computes (_Prefetch).

So between steps a rank holds 1/N of every parameter (plus one element per unit at most),
and at most two units' runs are gathered at a time on a straight forward or backward pass
(the one in use and the next); each is freed when its last use ends.
Any torch optimizer over ShardedModule.parameters() steps the slices (ShardedOptimizer with
stage=3 adds memory() and sharded state dicts). Buffers (BatchNorm statistics) stay
replicated. mixed_precision=torch.bfloat16 (or float16): runs are gathered and computed in
that dtype, the slices (the master copy) and their gradients stay in the parameters' dtype,
and gradients are reduced in it.

Every rank of the set must run the same forwards and backwards in the same order: the
gathers and reductions are collectives, so a unit whose output reaches the loss on some
ranks only leaves the others waiting (until RINGSYNC_TIMEOUT_SECONDS, then an error naming
the collective). FSDP asks the same. Not supported: a parameter shared
by two modules, double backward (create_graph=True) through a unit's saved weights.
"""
import contextlib
import itertools
import weakref

import torch

from ringsync._context import resolve
from ringsync._adapters import InstanceNumbers
from ringsync._requests import even_split
from ringsync.errors import CheckpointError, RingsyncError, UsageError
from ringsync.objects import allgather_object
from ringsync.ops import ReduceOp
from ringsync.process_sets import global_process_set

from . import mpi_ops
from ._claims import AVERAGED, claim
from ._sharded_state import held_bytes

Average = ReduceOp.AVERAGE
_instances = InstanceNumbers()  # collective names of each module
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Unit:
    """One submodule's own parameters of one dtype and trainability as a flat run; this
    rank keeps elements [lo, hi)."""

    def __init__(self, path, module, names, params, rank, size, name):
        self.path, self.module, self.names, self.name = path, module, names, name
        self.key = f"{path}:{','.join(names)}"  # (names the unit in checkpoints)
        self.shapes = [p.shape for p in params]
        self.offsets = list(itertools.accumulate((p.numel() for p in params), initial=0))
        self.numel = self.offsets[-1]
        self.dtype = params[0].dtype
        self.place(rank, size)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        self.shard = torch.nn.Parameter(flat[self.lo: self.hi].clone(),
                                        requires_grad=params[0].requires_grad)
        self.shard._ringsync_unit = self  # (ShardedOptimizer(stage=3) recognises its shards)
        self.gathered = None  # the run while the forward runs
        self.regathered = None  # the run gathered again for backward
        self.alive = weakref.WeakSet()  # every run gathered and not freed yet (for memory())

    def place(self, rank, size):
        """This rank's elements [lo, hi) of the run split over `size` ranks."""
        self.starts = list(itertools.accumulate(even_split(self.numel, size), initial=0))
        self.lo, self.hi = self.starts[rank], self.starts[rank + 1]

    def views(self, full):
        return [full[a: b].view(shape) for a, b, shape in
                zip(self.offsets, self.offsets[1:], self.shapes)]

    def set_attributes(self, tensors):
        for name, t in zip(self.names, tensors):
            setattr(self.module, name, t)


class _GatherRun(torch.autograd.Function):
    """The unit's full run from every rank's slice; backward reduce-scatters its gradient
    into the slice's."""

    @staticmethod
    def forward(ctx, shard, unit, owner):
        ctx.unit, ctx.owner = unit, owner
        return owner._gathered(unit, "gather")

    @staticmethod
    def backward(ctx, grad):
        unit, owner = ctx.unit, ctx.owner
        unit.regathered = None  # every saved view of this pass has been used by now
        grad = grad.to(unit.dtype).contiguous()
        mine = mpi_ops.reducescatter(grad, name=f"{unit.name}.grad", op=Average,
                                     process_set=owner._process_set)
        return mine, None, None


class _SavedView:
    """What the saved-tensor hook keeps instead of a view of a gathered run."""
    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit, t):
        self.unit, self.offset, self.size, self.stride = \
            unit, t.storage_offset(), t.size(), t.stride()


class _Prefetch:
    """Gathers started one unit ahead, in the order the first pass ran the units: forward's
    gathers in forward order, backward's ("regather") in the order backward first needed
    them. Every rank runs the same passes, so every rank starts the same gathers; a pass
    that leaves the recorded order stops running ahead. One gather at most runs ahead of
    the unit in use, so at most two runs are gathered at once."""

    def __init__(self, start_gather):
        self._start_gather = start_gather  # (unit, phase) -> the Handle of its allgather
        self._order = {"gather": None, "regather": None}  # the first pass's units, in order
        self._seen = {"gather": [], "regather": []}  # this pass's units so far
        self._on_track = {"gather": True, "regather": True}
        self._ahead = {}  # (unit, phase) -> Handle

    def restart(self):
        """A new pass (a forward, or slices about to change): the first complete one is
        the order from now on; gathers run ahead and not used are finished (every rank
        started them) and dropped — the slices may change before they would be used."""
        for phase, seen in self._seen.items():
            if self._order[phase] is None and seen:
                self._order[phase] = list(seen)
            seen.clear()
            self._on_track[phase] = True
        for handle in self._ahead.values():
            try:
                mpi_ops.synchronize(handle)
            except RingsyncError:
                pass  # (run ahead, never used: the collective that needs it will say)
        self._ahead.clear()

    def take(self, unit, phase):
        """The gather run ahead for unit, or None."""
        return self._ahead.pop((unit, phase), None)

    def run_ahead(self, unit, phase):
        """unit is in use: start the gather of the unit after it in the recorded order."""
        seen, order = self._seen[phase], self._order[phase]
        seen.append(unit)
        k = len(seen)
        self._on_track[phase] = self._on_track[phase] and order is not None and \
            k <= len(order) and order[k - 1] is unit
        if self._on_track[phase] and k < len(order) and order[k] is not unit and \
                (order[k], phase) not in self._ahead:  # (a unit used twice: gathered then)
            self._ahead[(order[k], phase)] = self._start_gather(order[k], phase)


class ShardedModule(torch.nn.Module):
    def __init__(self, module, process_set=global_process_set, mixed_precision=None,
                 broadcast_from_first_rank=True):
        """module: the full model (its parameters are moved into the shards; keep using it
        through this wrapper). process_set: the ranks that share the parameters.
        mixed_precision: None, torch.bfloat16 or torch.float16 — the dtype runs are
        gathered and computed in (floating inputs are cast to it too).
        broadcast_from_first_rank: start every rank from the set's first rank's parameters
        and buffers (as DistributedDataParallel does); False when they are known equal."""
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise UsageError(f"ShardedModule wraps a torch.nn.Module, got {type(module).__name__}")
        if mixed_precision is not None and mixed_precision not in _LOW_PRECISION:
            raise UsageError(f"ShardedModule: mixed_precision must be None, torch.bfloat16 or "
                             f"torch.float16, got {mixed_precision!r}")
        self.module = module
        self._process_set, self._compute_dtype = process_set, mixed_precision
        comm = resolve(process_set)
        self._rank, self._size = comm.rank(), comm.size()
        self._prefix = f"zero3.m{_instances.next(process_set)}"
        if broadcast_from_first_rank:
            self._broadcast_states()
        self._units = self._make_units()
        self.shards = torch.nn.ParameterList([u.shard for u in self._units])
        claim(self.shards, AVERAGED, self)  # (its backward averages their gradients)
        self._gathered_by_storage = {}
        self._prefetch = _Prefetch(self._start_gather)
        self._full_parameters = False
        for unit in self._units:
            unit.module.register_forward_pre_hook(self._make_pre_hook(unit))
            unit.module.register_forward_hook(self._make_post_hook(unit))

    # ---- construction ----

    def _broadcast_states(self):
        root = _first_rank(self._process_set)
        tensors = [t for t in itertools.chain(self.module.parameters(), self.module.buffers())]
        if self._size > 1 and tensors:
            with torch.no_grad():
                handles = [mpi_ops.broadcast_async_(t, root, name=f"{self._prefix}.init.{i}",
                                                    process_set=self._process_set)
                           for i, t in enumerate(tensors)]
                for h in handles:
                    mpi_ops.synchronize(h)

    def _make_units(self):
        seen, units = {}, []
        for path, sub in self.module.named_modules():
            own = list(sub.named_parameters(recurse=False))
            _check_parameters(path, own, seen)
            kinds = dict.fromkeys((p.dtype, p.requires_grad) for _, p in own)
            for kind in kinds:  # one run per dtype and trainability
                names = [n for n, p in own if (p.dtype, p.requires_grad) == kind]
                params = [p for n, p in own if (p.dtype, p.requires_grad) == kind]
                units.append(_Unit(path, sub, names, params, self._rank, self._size,
                                   f"{self._prefix}.u{len(units)}"))
            for n, _ in own:
                delattr(sub, n)  # the module's parameters now live in the slices
                setattr(sub, n, None)
        if not units:
            raise UsageError("ShardedModule: the module has no parameters to shard")
        return units

    # ---- gathering ----

    def _gathered(self, unit, phase):
        """The unit's run from every rank's slice, in the compute dtype: gathered ahead
        (_Prefetch), else now; the next unit's gather starts meanwhile."""
        handle = self._prefetch.take(unit, phase)
        if handle is None:
            handle = self._start_gather(unit, phase)
        full = mpi_ops.synchronize(handle)
        self._prefetch.run_ahead(unit, phase)
        unit.alive.add(full)
        return full

    def _start_gather(self, unit, phase):
        shard = unit.shard.detach()
        if self._compute_dtype is not None:
            shard = shard.to(self._compute_dtype)
        return mpi_ops.allgather_async(shard.contiguous(), name=f"{unit.name}.{phase}",
                                       process_set=self._process_set)

    def _make_pre_hook(self, unit):
        def gather_before_forward(module, args):
            if self._full_parameters:
                return
            full = _GatherRun.apply(unit.shard, unit, self)
            unit.gathered = full
            self._gathered_by_storage[full.untyped_storage().data_ptr()] = unit
            unit.set_attributes(unit.views(full))
        return gather_before_forward

    def _make_post_hook(self, unit):
        def drop_after_forward(module, args, output):
            if self._full_parameters or unit.gathered is None:
                return
            self._gathered_by_storage.pop(unit.gathered.untyped_storage().data_ptr(), None)
            unit.gathered = None
            unit.set_attributes([None] * len(unit.names))
        return drop_after_forward

    def _pack(self, t):
        unit = self._gathered_by_storage.get(t.untyped_storage().data_ptr()) \
            if t.numel() else None
        return t if unit is None else _SavedView(unit, t)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedView):
            return saved
        unit = saved.unit
        if unit.regathered is None:
            with torch.no_grad():
                unit.regathered = self._gathered(unit, "regather")
        return unit.regathered.as_strided(saved.size, saved.stride, saved.offset)

    def forward(self, *args, **kwargs):
        self._prefetch.restart()
        if self._compute_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self._compute_dtype)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def lay_out_again(self):
        """Re-shard over the process set as it is now (elastic recovery: the ring shrank):
        each slice becomes a new Parameter of this rank's new share, holding uninitialised
        values — the caller loads the committed ones next (load_parts) and puts the new
        Parameters in its optimizer. (New ones: a graph of the failed step may still hold
        the old one's gradient accumulator, which expects the old size.) Gathers run
        ahead on the failed ring are dropped. Returns {old Parameter: new Parameter}."""
        comm = resolve(self._process_set)
        self._rank, self._size = comm.rank(), comm.size()
        self._prefetch.restart()
        self._gathered_by_storage.clear()
        renamed = {}
        for unit in self._units:
            unit.place(self._rank, self._size)
            old = unit.shard
            unit.shard = torch.nn.Parameter(old.detach().new_empty(unit.hi - unit.lo),
                                            requires_grad=old.requires_grad)
            for name, value in vars(old).items():  # (its unit, which wrappers hold it)
                if name.startswith("_ringsync"):
                    setattr(unit.shard, name, value)
            unit.gathered = unit.regathered = None
            renamed[old] = unit.shard
        self.shards = torch.nn.ParameterList([u.shard for u in self._units])
        return renamed

    # ---- full parameters, on request ----

    @contextlib.contextmanager
    def gathered_parameters(self, writeback=True):
        """Every parameter whole, as a torch.nn.Parameter of its module, inside the block
        (for module.state_dict(), evaluation, inspection; every rank of the set must enter
        it). writeback: changes made to them inside are kept (each rank keeps its slice).
        A forward inside runs on the whole parameters and does not reach the shards'
        gradients."""
        if self._full_parameters:
            raise UsageError("ShardedModule.gathered_parameters: already inside one")
        self._prefetch.restart()  # (writeback changes the slices)
        with torch.no_grad():
            fulls = mpi_ops.grouped_allgather([u.shard.detach() for u in self._units],
                                              name=f"{self._prefix}.full",
                                              process_set=self._process_set)
        for unit, full in zip(self._units, fulls):
            for name, view in zip(unit.names, unit.views(full)):
                delattr(unit.module, name)
                unit.module.register_parameter(
                    name, torch.nn.Parameter(view, requires_grad=unit.shard.requires_grad))
        self._full_parameters = True
        try:
            yield self.module
        finally:
            self._full_parameters = False
            for unit, full in zip(self._units, fulls):
                if writeback:
                    with torch.no_grad():
                        unit.shard.copy_(full[unit.lo: unit.hi])
                for name in unit.names:
                    delattr(unit.module, name)
                    setattr(unit.module, name, None)

    # ---- accounting and layout ----

    def memory(self):
        """Bytes this rank holds, by kind: "parameters" (its slices and every gathered run
        still alive: held by a forward that runs, by autograd, or by the caller),
        "gradients" (the slices' gradients), "optimizer_state" (0: the optimizer's is
        counted by ShardedOptimizer.memory())."""
        gathered = [t for u in self._units for t in u.alive]
        return {"parameters": held_bytes([u.shard for u in self._units] + gathered),
                "gradients": held_bytes([u.shard.grad for u in self._units]),
                "optimizer_state": 0}

    def layout(self):
        """Where each rank's slices lie: one entry per unit — its module path, parameter
        names and shapes, dtype, and [lo, hi) of every rank of the set."""
        return [{"path": u.path, "names": list(u.names), "shapes": [list(s) for s in u.shapes],
                 "dtype": str(u.dtype), "starts": list(u.starts)} for u in self._units]

    def units(self):
        """(module path, this rank's slice Parameter, [lo, hi)) per unit."""
        return [(u.path, u.shard, (u.lo, u.hi)) for u in self._units]

    # ---- checkpoints (ringsync.torch.checkpoint) ----

    def save_parts(self, parts, rank):
        """This rank's slices into a checkpoint; rank 0 adds the layout and the buffers."""
        for u in self._units:
            parts.add_piece(f"model.{u.key}", u.shard, u.lo, u.numel)
        if rank == 0:
            parts.whole["model.layout"] = [_structure(e) for e in self.layout()]
            parts.whole["model.buffers"] = {n: b.detach().cpu().clone()
                                            for n, b in self.module.named_buffers()}

    def load_parts(self, reader):
        """This rank's slices (and the buffers) from a ShardedModule checkpoint saved on
        any number of ranks."""
        saved, mine = reader.whole("model.layout"), [_structure(e) for e in self.layout()]
        if saved != mine:
            diff = next((a, b) for a, b in itertools.zip_longest(saved, mine) if a != b)
            raise CheckpointError(f"ringsync.checkpoint: the checkpoint's model differs from "
                                  f"this one: saved {diff[0]}, here {diff[1]}")
        self._prefetch.restart()
        with torch.no_grad():
            for u in self._units:
                u.shard.copy_(reader.range(f"model.{u.key}", u.lo, u.hi, u.numel))
        load_buffers(self.module, reader.whole("model.buffers"))

    def load_full_state(self, state):
        """This rank's slices from a whole module's state_dict (a plain checkpoint)."""
        self._prefetch.restart()
        with torch.no_grad():
            for u in self._units:
                names = [f"{u.path}.{n}" if u.path else n for n in u.names]
                missing = [n for n in names if n not in state]
                if missing:
                    raise CheckpointError(f"ringsync.checkpoint: the saved model has no "
                                          f"{missing[0]!r}")
                flat = torch.cat([state[n].reshape(-1) for n in names])
                u.shard.copy_(flat[u.lo: u.hi])
        load_buffers(self.module, {n: state[n] for n, _ in self.module.named_buffers()
                                    if n in state})


def _structure(entry):
    """A layout entry without the split over ranks (which may change between runs)."""
    return {k: v for k, v in entry.items() if k != "starts"}


def load_buffers(module, saved):
    """A checkpoint's buffers into module's (CheckpointError naming one it lacks)."""
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name not in saved:
                raise CheckpointError(f"ringsync.checkpoint: the saved model has no buffer "
                                      f"{name!r}")
            buffer.copy_(saved[name])


def _check_parameters(path, own, seen):
    where = path or "the top module"
    for name, p in own:
        if not p.is_floating_point() or p.layout != torch.strided:
            raise UsageError(f"ShardedModule: {where}.{name} is a {p.layout} {p.dtype} "
                             "tensor; only dense floating-point parameters can be sharded")
        if p in seen:
            raise UsageError(f"ShardedModule: {where}.{name} is the same parameter as "
                             f"{seen[p]}; a parameter shared by two modules cannot be sharded")
        seen[p] = f"{where}.{name}"


def _first_rank(process_set):
    """The job rank of the set's first member."""
    ranks = getattr(process_set, "ranks", None)
    if ranks:
        return min(ranks)
    world = resolve(process_set).world_rank()
    return min(allgather_object(world, process_set=process_set))


def _cast_floating(value, dtype):
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value
