"""ShardedOptimizer: ZeRO stages 1, 2 (and 3, with ShardedModule) for PyTorch, built from
the core's allreduce, reducescatter and broadcast over a process set.

The trainable parameters are laid end to end, one flat run per dtype (in the optimizer's
parameter order; every parameter becomes a view of the run's buffer), cut into buckets at
parameter boundaries (bucket_cap_mb, as DDP's), and each rank of the set owns one
contiguous piece of every bucket, split as even_split splits (the first ranks one element
more): balanced by bytes. A new optimizer of the wrapped one's class, with the same
hyperparameters per param group, is built over this rank's pieces — views of the
parameters themselves, stepped in place; a separate fp32 master copy only for fp16/bf16
parameters or offload — so torch's own Adam/SGD/... arithmetic runs unchanged, and its
state (momentum, exp_avg, ...) exists for this rank's pieces only.

Gradients are averaged over the set (as DistributedOptimizer's op=Average) bucket by
bucket, starting during backward: a gradient hook starts a bucket's reduction as soon as
its last gradient is ready (after backward_passes_per_step passes).
- stage 1: each bucket is allreduced (p.grad then holds the average, as with
  DistributedOptimizer); this rank's piece of it feeds its optimizer.
- stage 2: each bucket is reduce-scattered in place: each rank keeps its piece of the
  average, and the bucket's p.grad are dropped (set to None) as it starts, so a rank holds
  the gradients of the buckets backward has not finished yet, plus its pieces.
step() waits for the reductions (starting those backward did not: a parameter with no
gradient on this rank counts as zeros), steps this rank's pieces, and each rank's pieces
are broadcast from it straight into everyone's parameters (no gathered copy of a bucket).
- stage 3: the parameters are a ShardedModule's slices (sharded_module.py), whose backward
  pass reduce-scattered their gradients already: step() steps them with the wrapped
  optimizer itself, and the next forward gathers them.
offload=True keeps the master pieces, their gradients and the optimizer state in a
separate host (CPU) buffer, pinned when CUDA is there, and steps there.
"""
import contextlib
import itertools
import weakref

import torch

from ringsync import autotune
from ringsync._context import resolve
from ringsync._adapters import InstanceNumbers
from ringsync._requests import even_split
from ringsync.errors import UsageError
from ringsync.objects import allgather_object
from ringsync.ops import ReduceOp
from ringsync.process_sets import global_process_set

from . import mpi_ops
from ._claims import AVERAGED, STEPPED, claim, refuse_held
from ._sharded_state import ShardedState, dtype_name, held_bytes, make_inner, make_shards
from .checkpoint import load_slice_state, save_slice_state

Average = ReduceOp.AVERAGE
_instances = InstanceNumbers()  # collective names of each optimizer


class _Run:
    """The trainable parameters of one dtype laid end to end, cut into buckets at parameter
    boundaries (each at most `cap` elements, or one parameter): a bucket is reduced as soon
    as backward has produced all of its gradients. Each bucket is split over the ranks as
    even_split splits (the first ranks one element more), and a rank owns its piece of
    every bucket: a reduce-scatter of the bucket hands each rank exactly its piece."""

    def __init__(self, dtype, params, size, cap):
        self.dtype, self.params = dtype, params
        self.offsets = list(itertools.accumulate((p.numel() for p in params), initial=0))
        self.numel = self.offsets[-1]
        self.buckets = _cut(self.offsets, cap)  # [(first parameter, end parameter)]
        self.spans = [(self.offsets[i], self.offsets[j]) for i, j in self.buckets]
        self.splits = [list(itertools.accumulate(even_split(b - a, size), initial=a))
                       for a, b in self.spans]
        self.flat = None  # every parameter's storage, end to end (lay_end_to_end)

    def lay_end_to_end(self, device):
        """Make every parameter a view of one flat buffer, in run order, so that each
        rank's piece of a bucket is one contiguous slice of the parameters: stepped in
        place, and gathered in place (the parameters' old storage is freed)."""
        self.flat = torch.empty(self.numel, dtype=self.dtype, device=device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                view = self.flat[off: off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view

    def pieces(self, rank):
        """The run elements [a, b) that rank owns, one per bucket, in run order."""
        return [(cuts[rank], cuts[rank + 1]) for cuts in self.splits]

    def owned_before(self, rank, at):
        return sum(max(0, min(b, at) - a) for a, b in self.pieces(rank))

    def bucket_params(self, k):
        i, j = self.buckets[k]
        return list(zip(self.params[i:j], self.offsets[i:j]))


def _cut(offsets, cap):
    """Bucket boundaries over parameters whose elements start at offsets[:-1]: consecutive
    parameters up to `cap` elements together, and a parameter of at least half the cap in
    a bucket of its own — its gradient is then reduced where autograd left it, with no
    copy into a bucket buffer (which would hold a large gradient twice)."""
    buckets, first, count = [], 0, len(offsets) - 1
    for i in range(count):
        alone = 2 * (offsets[i + 1] - offsets[i]) >= cap
        if i > first and (alone or offsets[i + 1] - offsets[first] > cap):
            buckets.append((first, i))
            first = i
        if alone:
            buckets.append((i, i + 1))
            first = i + 1
    return buckets + [(first, count)] if first < count else buckets


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer, named_parameters=None, stage=1,
                 process_set=global_process_set, offload=False, bucket_cap_mb=25,
                 backward_passes_per_step=1, redundancy=0):
        """optimizer: a torch.optim.Optimizer over the full model, not stepped yet (or its
        state is imported as with load_state_dict). It is kept for its param_groups
        (which LR schedulers change; step() passes every hyperparameter on) and rebuilt
        as `type(optimizer)(groups, **optimizer.defaults)` over this rank's slices.
        named_parameters: names for messages. stage: 1 (optimizer state sharded), 2
        (gradients too) or 3 (the optimizer is over ShardedModule.parameters()).
        process_set: the ranks that share the work (a ProcessSet or Communicator).
        offload: master slices and optimizer state in host memory.
        bucket_cap_mb: the most megabytes (2**20 bytes) of gradients reduced together (as
        DistributedDataParallel's): a bucket's reduction starts during backward, as soon
        as its last gradient is ready. backward_passes_per_step: gradients accumulate
        locally over this many backward passes before they are reduced (as Horovod's).
        Parameters with requires_grad=False are not sharded and never updated.
        redundancy: 0, or 1 — at every commit of an elastic TorchState each rank also
        keeps a copy of its left neighbour's committed part (pieces and optimizer state;
        at stage 3 the ShardedModule's slices too), so the survivors of a lost rank rebuild
        its part, re-shard over the ranks left and roll back to the commit in place."""
        # No super().__init__(), as DistributedOptimizer: the param_groups are the wrapped
        # optimizer's own (see the properties below).
        _check_arguments(optimizer, stage, offload, bucket_cap_mb, backward_passes_per_step,
                         redundancy)
        self.redundancy = redundancy
        self._bucket_cap_mb = bucket_cap_mb
        self._optimizer, self._stage, self._offload = optimizer, stage, offload
        self._process_set = process_set
        comm = resolve(process_set)
        self._rank, self._size = comm.rank(), comm.size()
        self._prefix = f"zero.opt{_instances.next(process_set)}"
        self._all = [p for g in optimizer.param_groups for p in g["params"]]
        names = _names(self._all, named_parameters)
        _check_stage(self._all, names, stage, offload)
        refuse_held(self._all, names, STEPPED, self, "ShardedOptimizer")
        self._device = _check_parameters(self._all, names)
        self._reduced = False
        self._should_synchronize = True
        self._reductions = _Reductions(stage, backward_passes_per_step, self._prefix,
                                       process_set)
        claim(self._all, STEPPED, self)
        if stage == 3:  # the ShardedModule's slices: stepped as they are
            self._runs, self._shards, self._inner = {}, [], optimizer
            self._states = ShardedState(optimizer, optimizer, [], self._all)
            return
        self._lay_out()
        claim(list(self._runs_params()), AVERAGED, self)
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self))
                       for p in self._bucket_of]
        if optimizer.state:  # a stepped optimizer: keep what it learnt
            self.load_state_dict(optimizer.state_dict())
            optimizer.state.clear()

    def _lay_out(self):
        """Runs, buckets and this rank's shards over the set as it is (self._rank of
        self._size), and the shard optimizer over them (with no state yet)."""
        # dtype -> _Run, in order of first appearance
        self._runs = _make_runs([p for p in self._all if p.requires_grad], self._size,
                                self._bucket_cap_mb)
        for run in self._runs.values():
            run.lay_end_to_end(self._device)
        host = torch.device("cpu") if self._offload else self._device
        pin = self._offload and host != self._device and torch.cuda.is_available()
        self._shards = make_shards(self._optimizer.param_groups, self._runs, self._rank, host,
                                   pin, in_place=not self._offload)
        self._inner = make_inner(self._optimizer, self._shards)
        self._states = ShardedState(self._optimizer, self._inner, self._shards, self._all)
        self._bucket_of = {p: (run, k) for run in self._runs.values()
                           for k in range(len(run.buckets)) for p, _ in run.bucket_params(k)}

    def lay_out_again(self, renamed=None):
        """Re-shard over the process set as it is now (elastic recovery: the ring
        shrank): pieces of the new size, a new shard optimizer with no state — the
        caller loads the committed state next (load_parts). Reductions in flight belong
        to the ring that failed: dropped. renamed (stage 3): the ShardedModule's
        {old slice: new slice} (its lay_out_again), put in their places."""
        comm = resolve(self._process_set)
        self._rank, self._size = comm.rank(), comm.size()
        self.reset_pending()
        if self._stage != 3:
            self._lay_out()
            return
        for group in self._optimizer.param_groups:
            group["params"] = [renamed.get(p, p) for p in group["params"]]
        self._all = [renamed.get(p, p) for p in self._all]
        self._states = ShardedState(self._optimizer, self._optimizer, [], self._all)
        self._optimizer.state.clear()

    def reset_pending(self):
        """Forget the reductions started on a ring that failed (elastic recovery: they
        never complete); the step starts over."""
        self._reductions.clear()
        self._reduced = False

    def _runs_params(self):
        return itertools.chain.from_iterable(run.params for run in self._runs.values())

    # ---- the wrapped optimizer's face ----

    @property
    def param_groups(self):
        """The wrapped optimizer's groups (full parameters); hyperparameters written here
        (by LR schedulers, say) reach the shard optimizer at the next step()."""
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._optimizer.param_groups = value

    @property
    def defaults(self):
        return self._optimizer.defaults

    @property
    def state(self):
        """The shard optimizer's state (keyed by this rank's flat shard tensors)."""
        return self._inner.state

    def add_param_group(self, param_group):
        raise UsageError("ShardedOptimizer.add_param_group is not supported: build the "
                         "optimizer with every param group before wrapping it")

    def __repr__(self):
        return f"ShardedOptimizer(stage={self._stage}, offload={self._offload}, {self._inner!r})"

    def _pass_hyperparameters(self):
        self._states.pass_hyperparameters()

    def _check_set(self):
        comm = resolve(self._process_set)
        if (comm.rank(), comm.size()) != (self._rank, self._size):
            raise UsageError(
                f"ShardedOptimizer was sharded over {self._size} ranks (this one rank "
                f"{self._rank}); the set is now {comm.size()} ranks (this one rank {comm.rank()}). "
                "Only an elastic TorchState re-shards (after a lost rank); otherwise "
                "consolidate_state_dict() before the change and load it into a new "
                "ShardedOptimizer")

    # ---- steps ----

    def _gradient_ready(self, p):
        """A gradient hook: p's bucket's reduction starts once all its gradients are in."""
        run, k = self._bucket_of[p]
        self._reductions.gradient_ready(run, k, p)

    def synchronize(self):
        """Average the gradients over the set: this rank's shard tensors get their slice of
        the average (stage 1: every p.grad holds the average as well; stage 2: every
        p.grad is dropped). Buckets backward has not started (a parameter without a
        gradient on this rank, or no backward at all) start here, missing gradients
        counting as zeros."""
        if self._reduced:
            return
        self._check_set()
        if self._stage == 3:  # the backward pass reduce-scattered them already
            self._reduced = True
            return
        pieces = self._reductions.pieces(self._runs.values(), self._rank)
        for s in self._shards:  # (each shard lies in one bucket: a view of its piece)
            at = s.at - s.run.owned_before(self._rank, s.run.spans[s.bucket][0])
            piece = pieces[(s.run.dtype, s.bucket)][at: at + s.numel]
            s.master.grad = piece.to(device=s.master.device, dtype=s.master.dtype)
        self._reduced = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For step() after an explicit synchronize()."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Reduce the gradients (unless skip_synchronize()), step this rank's shard with the
        wrapped optimizer's class, and allgather the updated parameters into place."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._should_synchronize:
            self.synchronize()
        elif not self._reduced:
            raise UsageError("ShardedOptimizer.step() under skip_synchronize() needs a "
                             "synchronize() first")
        self._reduced = False
        self._pass_hyperparameters()
        self._inner.step()
        if self._stage != 3:  # (stage 3: the next forward gathers them)
            self._allgather_parameters()
        autotune.step(resolve(self._process_set))  # (RINGSYNC_AUTOTUNE=1 only)
        return loss

    def _allgather_parameters(self):
        """Every rank's updated pieces into everyone's parameters, in place: a master copy
        that is not a view of the parameters (fp16/bf16, offload) is written back into
        this rank's piece first, then each rank's piece of every bucket is broadcast from
        its owner straight into the flat parameters (no second copy of a bucket)."""
        with torch.no_grad():
            for s in self._shards:
                if s.master.numel() and not s.is_view:
                    a, b = s.ranges[0]
                    s.run.flat[a: b].copy_(s.master.detach())
        world = resolve(self._process_set).world_ranks
        handles = [mpi_ops.broadcast_async_(
            run.flat[cuts[r]: cuts[r + 1]], world[r],
            name=f"{self._prefix}.params.{dtype_name(run.dtype)}.{k}.{r}",
            process_set=self._process_set)
            for run in self._runs.values() for k, cuts in enumerate(run.splits)
            for r in range(self._size) if cuts[r] < cuts[r + 1]]
        for handle in handles:
            mpi_ops.synchronize(handle)

    def zero_grad(self, set_to_none: bool = True):
        """As torch's. Reductions that backward started are finished first, and the rest
        started, as synchronize() does (every rank takes part in them), then dropped."""
        if self._reductions.inflight:
            self.synchronize()
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._inner.zero_grad(set_to_none=set_to_none)
        self._reduced = False

    # ---- accounting ----

    def memory(self):
        """Bytes of tensors this rank holds, by kind: "parameters" (the full parameters and
        this rank's master slices), "gradients" (p.grad kept and the shard gradients),
        "optimizer_state" (the shard optimizer's state). Tensors sharing storage count once."""
        grads = [p.grad for p in self._all] + [s.master.grad for s in self._shards] + \
            self._reductions.held()
        states = [self._inner.state] if self._inner is self._optimizer else \
            [self._inner.state, self._optimizer.state]
        state = [v for st in itertools.chain(*(s.values() for s in states))
                 for v in st.values() if torch.is_tensor(v)]
        return {"parameters": held_bytes(self._all + [s.master for s in self._shards]),
                "gradients": held_bytes(grads), "optimizer_state": held_bytes(state)}

    # ---- state ----

    def state_dict(self):
        """This rank's part: the shard optimizer's state_dict and the layout it belongs to.
        Loads back on the same rank of a set of the same size (see consolidate_state_dict
        for one full, torch-style state dict)."""
        self._pass_hyperparameters()
        return {"ringsync_sharded": {"stage": self._stage, "rank": self._rank,
                                     "size": self._size, "layout": self._layout()},
                "shard": self._inner.state_dict()}

    def _layout(self):
        if self._stage == 3:
            return [(str(p.dtype), p._ringsync_unit.numel) for p in self._all]
        return [(str(d), run.numel, run.spans) for d, run in self._runs.items()]

    def load_state_dict(self, state_dict):
        """Either this optimizer's own state_dict() (same rank, same set size) or a full
        torch-style optimizer state dict (consolidate_state_dict's, or the unsharded
        optimizer's), of which this rank takes its slices."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict and \
                "ringsync_sharded" not in state_dict:
            raise UsageError("ShardedOptimizer.load_state_dict: expected a ShardedOptimizer "
                             "state_dict() or a torch optimizer state dict")
        meta = state_dict.get("ringsync_sharded")
        if meta is None and self._stage == 3:
            raise UsageError("ShardedOptimizer(stage=3).load_state_dict takes its own "
                             "state_dict(); use ringsync.torch.checkpoint to change the rank count")
        if meta is None:
            self._states.load_full(state_dict)
        else:
            mine = {"rank": self._rank, "size": self._size, "layout": self._layout()}
            theirs = {k: meta.get(k) for k in mine}
            if theirs != mine:
                raise UsageError(f"ShardedOptimizer.load_state_dict: the state was saved by "
                                 f"{theirs}, this optimizer is {mine}; load a consolidated "
                                 "state dict to change the number of ranks")
            self._inner.load_state_dict(state_dict["shard"])
        self._states.take_hyperparameters()

    # ---- checkpoints (ringsync.torch.checkpoint) ----

    def save_parts(self, parts, rank):
        """This rank's slices of the master copies and of the per-element state into a
        checkpoint, per-tensor state whole; rank 0 adds the layout and hyperparameters."""
        if self._stage == 3:
            return save_slice_state(self._optimizer, parts, rank)
        self._states.save_parts(parts, rank)

    def load_parts(self, reader):
        """This rank's slices from a checkpoint saved on any number of ranks (the model's
        parameters are loaded separately, by ringsync.torch.checkpoint.load)."""
        if self._stage == 3:
            return load_slice_state(self._optimizer, reader)
        self._states.load_parts(reader)

    def consolidate_state_dict(self, to=0):
        """The full optimizer state, as the unsharded optimizer's state_dict() would give
        it (every parameter's state, indexed in param_groups order), on rank `to` (a rank
        of the job); None on the other ranks. Every rank of the set must call it. The
        shards travel as one allgather: each rank briefly holds the whole state."""
        self._check_set()
        if self._stage == 3:
            raise UsageError("ShardedOptimizer(stage=3).consolidate_state_dict is not "
                             "supported: save with ringsync.torch.checkpoint.save")
        self._pass_hyperparameters()
        mine = self._states.mine()
        world_rank = resolve(self._process_set).world_rank()
        everyone = allgather_object((world_rank, mine), name=f"{self._prefix}.consolidate",
                                    process_set=self._process_set)
        members = [r for r, _ in everyone]
        if to not in members:
            raise UsageError(f"ShardedOptimizer.consolidate_state_dict: to={to!r} is not a "
                             f"rank of the process set (its ranks: {members})")
        if world_rank != to:
            return None
        return self._states.consolidated([part for _, part in everyone])

class _Reductions:
    """The averaging of a ShardedOptimizer's gradient buckets over the set: a bucket starts
    from the gradient hooks once each of its parameters has had its backward passes
    (the rest of backward runs meanwhile), or at synchronize(). Stage 1 allreduces a
    bucket (every p.grad becomes a view of the average); stage 2 reduce-scatters it in
    place and keeps this rank's piece only (every p.grad is dropped as it starts)."""

    def __init__(self, stage, passes_per_step, prefix, process_set):
        self.stage, self.passes_per_step = stage, passes_per_step
        self.prefix, self.process_set = prefix, process_set
        self.passes = {}  # (dtype, bucket) -> {parameter: backward passes since the step}
        self.inflight = {}  # (dtype, bucket) -> [handle, flat gradients, result]

    def gradient_ready(self, run, k, p):
        passes = self.passes.setdefault((run.dtype, k), {})
        passes[p] = passes.get(p, 0) + 1
        if passes[p] > self.passes_per_step:
            raise UsageError(f"ShardedOptimizer: a gradient was computed more than "
                             f"backward_passes_per_step={self.passes_per_step} times before "
                             "step(); call step() (or synchronize()) first, or raise "
                             "backward_passes_per_step")
        members = run.buckets[k][1] - run.buckets[k][0]
        if len(passes) == members and all(n == self.passes_per_step for n in passes.values()):
            self.start(run, k)
        self.collect_finished()

    def start(self, run, k):
        """Start averaging bucket k of run; parameters without a gradient count as zeros."""
        members = run.bucket_params(k)
        flat = _flat_gradients(members, run.spans[k][0])
        name = f"{self.prefix}.grads.{dtype_name(run.dtype)}.{k}"
        if self.stage == 1:
            handle = mpi_ops.allreduce_async_(flat, op=Average, name=name,
                                              process_set=self.process_set)
            start = run.spans[k][0]
            for p, off in members:
                p.grad = flat[off - start: off - start + p.numel()].view_as(p)
        else:  # (in place: the flat gradients are the work space, no second copy)
            handle = mpi_ops.reducescatter_async_(flat, name=name, op=Average,
                                                  process_set=self.process_set)
        self.inflight[(run.dtype, k)] = [handle, flat, None]

    def collect_finished(self):
        """Take the results of the reductions that are done, so that stage 2 frees each
        bucket's gradients while backward still runs."""
        for entry in self.inflight.values():
            if entry[0] is not None and mpi_ops.poll(entry[0]):
                self._finish(entry)

    def _finish(self, entry):
        result = mpi_ops.synchronize(entry[0])
        entry[0] = None
        if self.stage == 2:  # (the piece is a view of the flat gradients: kept alone)
            entry[1], entry[2] = None, result.clone()
        else:
            entry[2] = entry[1]

    def pieces(self, runs, rank):
        """(dtype, bucket) -> this rank's piece of every bucket's average, once each is
        done (those backward did not start start now); then nothing is in flight."""
        for run in runs:
            for k in range(len(run.buckets)):
                if (run.dtype, k) not in self.inflight:
                    self.start(run, k)
        pieces = {}
        for run in runs:
            for k, cuts in enumerate(run.splits):
                entry = self.inflight[(run.dtype, k)]
                if entry[0] is not None:
                    self._finish(entry)
                a = run.spans[k][0]
                pieces[(run.dtype, k)] = entry[2] if self.stage == 2 else \
                    entry[2][cuts[rank] - a: cuts[rank + 1] - a]
        self.clear()
        return pieces

    def held(self):
        """The gradient tensors in flight (for memory())."""
        return [t for entry in self.inflight.values() for t in entry[1:]]

    def clear(self):
        self.inflight.clear()
        self.passes.clear()


def _flat_gradients(members, start):
    """The gradients of members ((parameter, offset) pairs, consecutive from `start`) laid
    end to end, zeros where a parameter has none, each p.grad dropped once copied: the
    gradients are never held twice (the new buffer's pages cost memory only as written).
    A bucket of one parameter whose gradient is dense and contiguous: that gradient itself
    (the caller reduces it in place)."""
    (first, _), (last, end) = members[0], members[-1]
    grad = first.grad
    if len(members) == 1 and grad is not None and grad.layout == torch.strided and \
            grad.is_contiguous() and grad.dtype == first.dtype:
        first.grad = None
        return grad.view(-1)
    flat = torch.empty(end + last.numel() - start, dtype=last.dtype, device=last.device)
    for p, off in members:
        piece = flat[off - start: off - start + p.numel()]
        if p.grad is None:
            piece.zero_()
        else:
            piece.copy_((p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1))
        p.grad = None
    return flat


def _weak_hook(optimizer):
    """A gradient hook that does not keep the optimizer alive: once it is dropped (a new
    ShardedOptimizer built over the same parameters, say), its hooks do nothing, instead
    of starting reductions nobody waits for."""
    ref = weakref.ref(optimizer)

    def hook(p):
        alive = ref()
        if alive is not None:
            alive._gradient_ready(p)
    return hook


def _make_runs(trainable, size, bucket_cap_mb):
    """dtype -> the _Run of the trainable parameters of that dtype (in order of first
    appearance), cut into buckets of at most bucket_cap_mb megabytes."""
    cap_bytes = int(bucket_cap_mb * (1 << 20))
    dtypes = dict.fromkeys(p.dtype for p in trainable)
    return {d: _Run(d, [p for p in trainable if p.dtype is d], size,
                    max(1, cap_bytes // torch.empty(0, dtype=d).element_size()))
            for d in dtypes}


def _check_arguments(optimizer, stage, offload, bucket_cap_mb, backward_passes_per_step,
                     redundancy):
    if isinstance(redundancy, bool) or redundancy not in (0, 1):
        raise UsageError(f"ShardedOptimizer: redundancy must be 0 or 1, got {redundancy!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"ShardedOptimizer wraps a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise UsageError(f"ShardedOptimizer: stage must be 1, 2 or 3, got {stage!r}")
    if not isinstance(offload, bool):
        raise UsageError(f"ShardedOptimizer: offload must be True or False, got {offload!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb > 0:
        raise UsageError(f"ShardedOptimizer: bucket_cap_mb must be a positive number, got "
                         f"{bucket_cap_mb!r}")
    if isinstance(backward_passes_per_step, bool) or \
            not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise UsageError(f"ShardedOptimizer: backward_passes_per_step must be an int of at "
                         f"least 1, got {backward_passes_per_step!r}")


def _names(params, named_parameters):
    """Each parameter's name, for messages: from named_parameters, else its position."""
    if named_parameters is None:
        return [f"parameter {i}" for i in range(len(params))]
    by_param = {}
    for name, p in named_parameters:
        by_param[p] = f"'{name}'"
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise UsageError(f"ShardedOptimizer: named_parameters does not name every parameter "
                         f"of the optimizer (parameters at positions {missing[:10]} are missing)")
    return [by_param[p] for p in params]


def _check_stage(params, names, stage, offload):
    """Stage 3 steps a ShardedModule's slices, and only those; stages 1 and 2 shard whole
    parameters, never such slices."""
    sliced = [hasattr(p, "_ringsync_unit") for p in params]
    if stage == 3:
        if offload:
            raise UsageError("ShardedOptimizer: offload=True is not supported at stage 3")
        if not all(sliced):
            name = names[sliced.index(False)]
            raise UsageError(f"ShardedOptimizer(stage=3) steps a ShardedModule's parameters; "
                             f"{name} is not one (pass sharded_module.parameters())")
    elif any(sliced):
        name = names[sliced.index(True)]
        raise UsageError(f"ShardedOptimizer(stage={stage}): {name} is already a ShardedModule "
                         "slice; use stage=3")


def _check_parameters(params, names):
    """The device every parameter is on; UsageError naming the first one that cannot be
    sharded."""
    if not any(p.requires_grad for p in params):
        raise UsageError("ShardedOptimizer: the optimizer has no parameter that requires grad")
    device = None
    for p, name in zip(params, names):
        if not p.is_floating_point():
            raise UsageError(f"ShardedOptimizer: {name} is {p.dtype}; only floating-point "
                             "parameters can be sharded")
        if p.layout != torch.strided:
            raise UsageError(f"ShardedOptimizer: {name} is a {p.layout} tensor; only dense "
                             "parameters can be sharded")
        device = device or p.device
        if p.device != device:
            raise UsageError(f"ShardedOptimizer: parameters on more than one device ({name} is "
                             f"on {p.device}, earlier ones on {device})")
    return device
