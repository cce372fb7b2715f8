"""DistributedOptimizer: averages gradients over all ranks while backward() still runs.

It wraps the user's optimizer by composition. Each parameter gets a public
post-accumulate-grad hook: as soon as its gradient is complete (after
backward_passes_per_step passes), an asynchronous allreduce starts, so communication
overlaps the rest of the backward pass. step() waits for the reductions, then steps the
wrapped optimizer. The class derives from torch.optim.Optimizer only so that LR schedulers
and isinstance checks accept it; all state lives in the wrapped optimizer.
"""
import contextlib
import os
import warnings

import torch

from ringsync import autotune
from ringsync.ops import ReduceOp
from ringsync.process_sets import ProcessSet, global_process_set
from ringsync._context import resolve
from ringsync._adapters import InstanceNumbers, groups_from_num_groups, near_equal_runs
from ringsync.errors import UsageError

from . import mpi_ops
from ._buckets import BucketViews, Buckets
from ._claims import AVERAGED, refuse_held
from ._tensors import to_numpy
from .compression import Compression

_instances = InstanceNumbers()  # names of unnamed optimizers


def overlaps(comm) -> bool:
    """Whether gradients are reduced during backward on comm: as every rank agreed
    (RINGSYNC_OVERLAP=on/off, or what autotune chose), else torch's rule for auto: yes,
    unless every rank shares this host (the same-host lane) with fewer than two cores per
    local rank, where a reduction during backward could only take cores from it. The
    same on every rank: it looks only at what the ranks of one host share."""
    agreed = comm.overlaps
    if agreed is not None:
        return agreed
    spare = (os.cpu_count() or 1) / comm.local_size() >= 2
    return not comm.uses_lane or spare


_AT_STEP = "reduced at step"  # a pending gradient that synchronize() reduces
_IN_BUCKET = "in a bucket"  # a pending gradient that its bucket's allreduce reduces
_BUCKET = "bucket"  # a pending bucket (keyed by the Bucket)


class DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set, *, gradient_as_bucket_view=False):
        """Horovod's arguments. groups: an int N (the parameters in N nearly equal runs)
        or a list of lists of parameters, each reduced as one grouped allreduce once all
        its gradients are ready (num_groups: the deprecated spelling of an int).
        sparse_as_dense: sparse gradients are reduced as dense tensors (else as sparse:
        every rank's entries gathered). process_set: the ranks that average the gradients
        (a ProcessSet or Communicator; the job's, whichever it is at each step: elastic
        recovery replaces it).

        gradient_as_bucket_view (keyword only; DDP's flag): gradients become views of the
        buffers they are reduced in (see _buckets.py). The hazard, as with DDP's: p.grad
        is the same memory from step to step, so a gradient kept from an earlier step
        changes; keep a clone()."""
        # Deliberately no super().__init__(): param_groups and state are the wrapped
        # optimizer's own (see the properties below), so there is one copy of each.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                             f"{type(optimizer).__name__}")
        _check_passes(backward_passes_per_step)
        if gradient_predivide_factor != 1.0 and ReduceOp(op) != ReduceOp.AVERAGE:
            raise UsageError("gradient_predivide_factor only applies to op=Average")
        self._optimizer = optimizer
        self._compression = compression
        self._passes_per_step = backward_passes_per_step
        self._op, self._process_set = op, process_set
        self._predivide, self._sparse_as_dense = gradient_predivide_factor, sparse_as_dense
        self._prefix = f"grad.opt{_instances.next(process_set)}"
        self._names = parameter_names(optimizer, named_parameters, self._prefix)
        refuse_held(self._names, [f"parameter {n!r}" for n in self._names.values()], AVERAGED,
                    self, "DistributedOptimizer")
        self._at_step = StepBuffers(f"{self._prefix}.gradients",
                                    as_views=bool(gradient_as_bucket_view))
        # (gradient_as_bucket_view with overlap: gradients reduced in buckets from the hooks)
        self._buckets = Buckets(f"{self._prefix}.gradients") if gradient_as_bucket_view \
            else None
        self._auto_overlap = (None, True)  # (communicator, overlaps(communicator))
        self._group_of = _gradient_groups(list(self._names), num_groups, groups)
        self._pending = {}  # parameter -> (handle, wire tensor, compression context)
        self._ready_in_group = {}  # group -> its parameters whose gradients are ready
        self._prepared = {}  # parameter -> (PreparedAllreduce, grad dtype, grad shape)
        if ReduceOp(op) == ReduceOp.AVERAGE:
            self._scale = dict(prescale_factor=1.0 / gradient_predivide_factor,
                               postscale_factor=gradient_predivide_factor)
        else:
            self._scale = {}
        self._passes = {p: 0 for p in self._names}
        self._synchronized = False
        self._should_synchronize = True
        # Adasum combines the ranks' *updates* (how each rank's own optimizer would move
        # the weights), not their gradients: step() computes them (see _adasum_step).
        self._adasum = ReduceOp(op) == ReduceOp.ADASUM
        # Horovod's rule for a rank outside process_set: its gradients stay its own
        # (unreduced), and step() is the wrapped optimizer's.
        self._local = outside(process_set)
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                       for p in self._names if p.requires_grad and not self._local]

    def set_backward_passes_per_step(self, passes: int):
        """Reduce every `passes` backward passes from now on (gradients accumulate locally
        in between)."""
        _check_passes(passes)
        self._passes_per_step = passes
        self._passes = {p: 0 for p in self._names}

    # ---- the wrapped optimizer's state, shared rather than copied ----

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._optimizer.param_groups = value

    @property
    def state(self):
        return self._optimizer.state

    @property
    def defaults(self):
        return self._optimizer.defaults

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self._optimizer.add_param_group(param_group)
        base = len(self._names)
        for i, p in enumerate(self._optimizer.param_groups[-1]["params"]):
            if p not in self._names:
                self._names[p] = f"{self._prefix}.{base + i}"
                self._passes[p] = 0
                if p.requires_grad and not self._local:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._gradient_ready))

    def __repr__(self):
        return f"DistributedOptimizer({self._optimizer!r})"

    # ---- names ----

    # ---- reductions ----

    def _gradient_ready(self, p):
        """Hook: p.grad has been accumulated by one backward pass."""
        if p in self._pending or p in self._ready_in_group.get(self._group_of.get(p), ()):
            raise UsageError(
                f"the gradient of '{self._names[p]}' was computed more than "
                f"backward_passes_per_step={self._passes_per_step} times before step(); call "
                "step() (or synchronize()) first, or raise backward_passes_per_step")
        self._passes[p] += 1
        if self._passes[p] == self._passes_per_step and not self._adasum:
            self._gradient_complete(p)

    def _gradient_complete(self, p):
        group = self._group_of.get(p)
        if group is None:
            self._start_reduction(p)
            return
        ready = self._ready_in_group.setdefault(group, set())  # (tensors hash by identity)
        ready.add(p)
        if len(ready) == len(group):
            self._start_group(group)

    def _start_reduction(self, p):
        self._passes[p] = 0
        grad = self._dense_grad(p)
        if grad.is_sparse:
            wait = mpi_ops.sparse_allreduce_async(grad, self._names[p], self._op,
                                                  self._process_set)
            self._pending[p] = (wait, None, "sparse")
            return
        if self._defers(grad):
            self._pending[p] = (None, grad, _AT_STEP)  # reduced by synchronize()
            return
        if self._buckets is not None and self._buckets.is_view(p):
            self._bucket_ready(p)
            return
        handle = self._start_prepared(p)
        if handle is not None:
            self._pending[p] = (handle, p.grad, None)
        else:
            wire, ctx = self._compression.compress(p.grad)
            handle = mpi_ops.allreduce_async_(wire, op=self._op, name=self._names[p],
                                              process_set=self._process_set, **self._scale)
            self._pending[p] = (handle, wire, ctx)

    def _bucket_ready(self, p):
        """p's gradient (a view of its bucket) is complete: its bucket starts with its last."""
        self._pending[p] = (None, None, _IN_BUCKET)
        bucket = self._buckets.ready(p)
        if bucket is not None:
            handle = bucket.start(resolve(self._process_set), self._op, self._scale)
            self._pending[bucket] = (handle, None, _BUCKET)

    def _bind_buckets(self):
        """After a step's reductions with gradient_as_bucket_view and overlap: every dense
        CPU gradient becomes (or stays) a view of its bucket, for the next step's hooks."""
        if self._buckets is None or self._compression is not Compression.none or \
                self._group_of or not self._overlaps(resolve(self._process_set)):
            return
        params = [p for p in self._names if p.requires_grad and p.grad is not None]
        if all(p.grad.device.type == "cpu" and not p.grad.is_sparse for p in params):
            self._buckets.build(params)

    def _defers(self, grad) -> bool:
        """Whether this gradient waits for synchronize() (RINGSYNC_OVERLAP off): plain
        dense CPU gradients, where nothing is to be compressed or grouped."""
        return (self._compression is Compression.none and not self._group_of and
                grad.device.type == "cpu" and grad.is_contiguous() and
                not self._overlaps(resolve(self._process_set)))

    def _overlaps(self, comm) -> bool:
        """overlaps(comm), its auto rule worked out once per communicator (every gradient
        asks; the agreed choice can change with autotune, so it is read each time)."""
        agreed = comm.overlaps
        if agreed is not None:
            return agreed
        if self._auto_overlap[0] is not comm:
            self._auto_overlap = (comm, overlaps(comm))
        return self._auto_overlap[1]

    def _dense_grad(self, p):
        """p.grad, made to exist (zeros for a parameter that took no part this step on
        this rank) and dense where sparse gradients are to travel dense."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse and self._sparse_as_dense:
            p.grad = p.grad.to_dense()
        return p.grad

    def _start_group(self, group):
        """Every gradient of the group is ready: one grouped allreduce for all of them."""
        self._ready_in_group.pop(group, None)
        grads = []
        for p in group:
            self._passes[p] = 0
            grad = self._dense_grad(p)
            if grad.is_sparse:
                grad = p.grad = grad.to_dense()  # a group travels as one dense unit
            grads.append(self._compression.compress(grad))
        handle = mpi_ops.grouped_allreduce_async_(
            [w for w, _ in grads], op=self._op, name=f"{self._names[group[0]]}.group",
            process_set=self._process_set, **self._scale)
        for i, (p, (wire, ctx)) in enumerate(zip(group, grads)):
            self._pending[p] = (handle if i == 0 else None, wire, ctx)

    def _start_prepared(self, p):
        """The common case — an uncompressed, contiguous CPU gradient — submitted through a
        request prepared once per parameter (per communicator: elastic recovery makes a
        new one): a hook then costs a few microseconds instead of building a request.
        None where the general path must run."""
        grad = p.grad
        if self._compression is not Compression.none or grad.device.type != "cpu" or \
                not grad.is_contiguous() or grad.numel() == 0:
            return None
        comm = resolve(self._process_set)
        cached = self._prepared.get(p)
        if cached is None or cached[0].comm is not comm or cached[1] is not grad.dtype or \
                cached[2] != grad.shape:
            like = to_numpy(grad.detach(), "DistributedOptimizer")
            cached = (comm.prepare_allreduce_(self._names[p], like, self._op, **self._scale),
                      grad.dtype, grad.shape)
            self._prepared[p] = cached
        return cached[0].start(grad.data_ptr(), grad)

    def synchronize(self):
        """Wait until every parameter's gradient holds its reduction over all ranks.
        Parameters whose gradient did not arrive this step (on this rank) are reduced too,
        as zeros, so that every rank reduces the same tensors. (Nothing with op=Adasum,
        which step() reduces, and on a rank outside process_set.)"""
        if self._local:
            self._synchronized = True
            return
        if self._adasum:
            return
        for group in dict.fromkeys(self._group_of.values()):  # (in parameter order)
            if any(p not in self._pending for p in group):  # (dict lookups: by identity)
                self._start_group(group)  # the same groups on every rank, in one order
        for p in self._names:
            if p.requires_grad and p not in self._pending:
                self._start_reduction(p)
        pending, self._pending = self._pending, {}
        failure = None
        deferred = [p for p in self._names if pending.get(p, (0, 0, 0))[2] is _AT_STEP]
        if deferred:  # (in parameter order, not the order gradients arrived in)
            try:
                self._at_step.reduce(resolve(self._process_set), deferred, self._op,
                                     self._scale)
            except Exception as e:  # the others still complete before it is raised
                failure = e
        for p, (handle, wire, ctx) in pending.items():
            if ctx is _AT_STEP or ctx is _IN_BUCKET:
                continue
            try:
                result = handle() if ctx == "sparse" else \
                    (mpi_ops.synchronize(handle) if handle is not None else None)
            except Exception as e:  # wait for the others, then raise the first failure
                failure = failure or e
                continue
            if ctx == "sparse":
                p.grad = result.coalesce()
            elif ctx is not _BUCKET and wire is not p.grad:  # (a bucket: reduced in place)
                with torch.no_grad():
                    p.grad.copy_(self._compression.decompress(wire, ctx))
        self._synchronized = True
        if failure is not None:
            raise failure
        self._bind_buckets()

    def reset_pending(self):
        """Forget the reductions in flight, which a failed ring will never complete
        (elastic recovery calls this); the gradients keep whatever they hold."""
        self._pending = {}
        self._ready_in_group = {}
        if self._buckets is not None:
            self._buckets.reset()
        self._passes = {p: 0 for p in self._names}
        self._synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For step() after an explicit synchronize() (e.g. to clip averaged gradients)."""
        if self._adasum:
            raise UsageError("skip_synchronize() does not apply to op=Adasum: its step() "
                             "combines weight updates, not gradients")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _adasum_step(self, closure):
        """Horovod's Adasum optimizer: each rank steps its own optimizer on its own
        gradients, the weight changes are combined with Adasum (one tensor each, so each
        has its own coefficients), and every rank applies the combination to the weights
        it started from. Every parameter takes part on every rank (zero gradients where
        none arrived), so that ranks reduce the same tensors."""
        loss = closure() if closure is not None else None
        params = [p for p in self._names if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
            self._optimizer.step()
            sent = []
            for p, start in zip(params, starts):
                wire, ctx = self._compression.compress(p.detach() - start)
                handle = mpi_ops.allreduce_async_(wire, op=self._op, name=self._names[p],
                                                  process_set=self._process_set)
                sent.append((handle, wire, ctx))
            for p, start, (handle, wire, ctx) in zip(params, starts, sent):
                delta = self._compression.decompress(mpi_ops.synchronize(handle), ctx)
                p.copy_(start + delta)
        self._passes = {p: 0 for p in self._names}
        return loss

    def step(self, closure=None):
        if self._local:
            self._synchronized = False
            return self._optimizer.step(closure) if closure is not None else \
                self._optimizer.step()
        if self._adasum:
            return self._adasum_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): gradients are reduced again",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        result = self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        # (RINGSYNC_AUTOTUNE=1 only; this optimizer's reductions follow `overlaps`)
        autotune.step(resolve(self._process_set), overlap_matters=not self._group_of)
        return result

    def zero_grad(self, set_to_none: bool = True):
        if self._pending:
            raise UsageError(
                f"optimizer.zero_grad() was called while {len(self._pending)} gradient "
                "reductions are pending; call step() or synchronize() first")
        # (gradient_as_bucket_view: the gradients stay views of the buffer, zeroed in place)
        self._optimizer.zero_grad(set_to_none=set_to_none and not self._at_step.as_views)


class StepBuffers:
    """The gradients a DistributedOptimizer reduces at step() (overlap off): one allreduce
    per dtype, in the order given (parameter order: the same on every rank), copied into
    one buffer, reduced in place on the calling thread (with every rank on one host: the
    lane, staged through shared memory, no engine thread), copied back. as_views
    (gradient_as_bucket_view): the gradients are views of the buffer instead, and nothing
    is copied (but a gradient that is not a view yet, which is copied in once)."""

    def __init__(self, name: str, as_views: bool = False):
        self._name = name
        self.as_views = as_views
        self._flat = {}  # dtype -> the buffer its gradients are reduced in (copies)
        self._views = BucketViews()  # (as_views)

    def reduce(self, comm, params, op, scale) -> None:
        by_dtype = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for dtype, group in by_dtype.items():
            if self.as_views:
                flat = self._views.bind(dtype, group)
            else:
                flat = self._buffer(dtype, sum(p.grad.numel() for p in group))
                torch.cat([p.grad.reshape(-1) for p in group], out=flat)
            comm.allreduce_(to_numpy(flat, "DistributedOptimizer"), op=op,
                            name=f"{self._name}.{str(dtype).replace('torch.', '')}", **scale)
            if not self.as_views:
                at = 0
                for p in group:
                    n = p.grad.numel()
                    p.grad.copy_(flat[at:at + n].view_as(p.grad))
                    at += n

    def _buffer(self, dtype, numel):
        """dtype's buffer, kept from step to step (a new one each step costs its page
        faults, as much as a copy or more; p.grad never points into it, so nothing the
        caller holds sees it change)."""
        flat = self._flat.get(dtype)
        if flat is None or flat.numel() != numel:
            flat = self._flat[dtype] = torch.empty(numel, dtype=dtype)
        return flat


def parameter_names(optimizer, named_parameters, prefix: str) -> dict:
    """parameter -> its gradient's tensor name: "grad.<name>" from named_parameters (each
    name once, every parameter named), else "<prefix>.<position>"."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"{prefix}.{i}" for i, p in enumerate(params)}
    named = _name_pairs(named_parameters)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise UsageError(f"named_parameters has duplicate names: {dupes}")
    by_param = {p: f"grad.{n}" for n, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in by_param]
    if unnamed:
        raise UsageError(f"named_parameters does not name every parameter of the optimizer "
                         f"(parameters at positions {unnamed[:10]} are missing)")
    return {p: by_param[p] for p in params}


def outside(process_set) -> bool:
    """Whether this rank is outside process_set (a ProcessSet; a Communicator is always
    this rank's own)."""
    return isinstance(process_set, ProcessSet) and process_set.included() is False


def _name_pairs(named_parameters):
    """Horovod's rule: any iterable of (name, parameter) tuples, such as what
    model.named_parameters() returns; anything else is refused as Horovod refuses it (a
    TypeError for what cannot be iterated, a ValueError for items that are not such
    tuples), saying what was given."""
    if callable(named_parameters) and not hasattr(named_parameters, "__iter__"):
        raise TypeError(f"named_parameters should be an iterable of (name, parameter) tuples, "
                        f"got the callable {getattr(named_parameters, '__qualname__', '?')}: "
                        f"call it (model.named_parameters())")
    try:
        named = list(named_parameters)
    except TypeError:
        raise TypeError(f"named_parameters should be an iterable of (name, parameter) tuples "
                        f"(model.named_parameters()), got {type(named_parameters).__name__}") \
            from None
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and
                isinstance(item[1], torch.Tensor)):
            hint = " (for a dict, pass its .items())" if isinstance(named_parameters, dict) \
                else ""
            raise UsageError(f"named_parameters should be a sequence of (name, parameter) "
                             f"tuples, usually model.named_parameters(); an item is "
                             f"{type(item).__name__} {_short(item)}{hint}")
    return named


def _short(item) -> str:
    text = repr(item) if not isinstance(item, torch.Tensor) else f"of shape {list(item.shape)}"
    return text if len(text) <= 60 else text[:57] + "..."


def _check_passes(passes) -> None:
    if not isinstance(passes, int) or passes < 1:
        raise UsageError(f"backward_passes_per_step must be an int of at least 1, got {passes!r}")


def _gradient_groups(params, num_groups, groups):
    """parameter -> its group (a tuple of parameters, in optimizer order), for the
    parameters reduced in groups; the others are reduced one by one."""
    groups = groups_from_num_groups(num_groups, groups)
    if groups is None:
        return {}
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1:
            raise UsageError(f"groups should be a positive int or a list of lists of "
                             f"parameters, got {groups}")
        runs = near_equal_runs(params, groups)
    else:
        runs = [list(g) for g in groups]
        flat = [p for g in runs for p in g]
        if any(not isinstance(p, torch.Tensor) for p in flat):
            raise UsageError("groups must consist of torch.Tensor")
        if len({id(p) for p in flat}) != len(flat):
            raise UsageError("a parameter can only appear once in groups")
    order = {p: i for i, p in enumerate(params)}
    group_of = {}
    for run in runs:
        members = tuple(sorted((p for p in run if p in order and p.requires_grad),
                               key=order.get))
        for p in members:
            group_of[p] = members
    return group_of
