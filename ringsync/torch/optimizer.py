"""DistributedOptimizer: averages gradients over all ranks while backward() still runs.

It wraps the user's optimizer by composition. Each parameter gets a public
post-accumulate-grad hook: as soon as its gradient is complete (after
backward_passes_per_step passes), an asynchronous allreduce starts, so communication
overlaps the rest of the backward pass. step() waits for the reductions, then steps the
wrapped optimizer. The class derives from torch.optim.Optimizer only so that LR schedulers
and isinstance checks accept it; all state lives in the wrapped optimizer.
"""
import contextlib
import itertools
import warnings

import torch

from ringsync import Average, ReduceOp
from ringsync._core import prepare_allreduce_
from ringsync.errors import UsageError

from . import mpi_ops
from ._tensors import to_numpy
from .compression import Compression

_instances = itertools.count()  # names of unnamed optimizers, in construction order


class DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                 process_set=None):
        """process_set: the Communicator whose ranks average the gradients (default: the
        one init() made, whichever it is at each step: elastic recovery replaces it)."""
        # Deliberately no super().__init__(): param_groups and state are the wrapped
        # optimizer's own (see the properties below), so there is one copy of each.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                             f"{type(optimizer).__name__}")
        if backward_passes_per_step < 1:
            raise UsageError(f"backward_passes_per_step must be at least 1, got "
                             f"{backward_passes_per_step}")
        if gradient_predivide_factor != 1.0 and ReduceOp(op) != ReduceOp.AVERAGE:
            raise UsageError("gradient_predivide_factor only applies to op=Average")
        self._optimizer = optimizer
        self._compression = compression
        self._passes_per_step = backward_passes_per_step
        self._op = op
        self._process_set = process_set
        self._predivide = gradient_predivide_factor
        self._names = self._parameter_names(named_parameters, next(_instances))
        self._pending = {}  # parameter -> (handle, wire tensor, compression context)
        self._prepared = {}  # parameter -> (PreparedAllreduce, grad dtype, grad shape)
        if ReduceOp(op) == ReduceOp.AVERAGE:
            self._scale = dict(prescale_factor=1.0 / gradient_predivide_factor,
                               postscale_factor=gradient_predivide_factor)
        else:
            self._scale = {}
        self._passes = {p: 0 for p in self._names}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready)
                       for p in self._names if p.requires_grad]

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
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._gradient_ready))

    def __repr__(self):
        return f"DistributedOptimizer({self._optimizer!r})"

    # ---- names ----

    def _parameter_names(self, named_parameters, instance):
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        self._prefix = f"grad.opt{instance}"
        if named_parameters is None:
            return {p: f"{self._prefix}.{i}" for i, p in enumerate(params)}
        named = list(named_parameters)
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

    # ---- reductions ----

    def _gradient_ready(self, p):
        """Hook: p.grad has been accumulated by one backward pass."""
        if p in self._pending:
            raise UsageError(
                f"the gradient of '{self._names[p]}' was computed more than "
                f"backward_passes_per_step={self._passes_per_step} times before step(); call "
                "step() (or synchronize()) first, or raise backward_passes_per_step")
        self._passes[p] += 1
        if self._passes[p] == self._passes_per_step:
            self._start_reduction(p)

    def _start_reduction(self, p):
        if p.grad is None:  # a parameter that took no part in this step on this rank
            p.grad = torch.zeros_like(p)
        handle = self._start_prepared(p)
        if handle is not None:
            self._pending[p] = (handle, p.grad, None)
        else:
            wire, ctx = self._compression.compress(p.grad)
            handle = mpi_ops.allreduce_async_(wire, op=self._op, name=self._names[p],
                                              process_set=self._process_set, **self._scale)
            self._pending[p] = (handle, wire, ctx)
        self._passes[p] = 0

    def _start_prepared(self, p):
        """The common case — an uncompressed, contiguous CPU gradient — submitted through a
        request prepared once per parameter (per communicator: elastic recovery makes a
        new one): a hook then costs a few microseconds instead of building a request.
        None where the general path must run."""
        grad = p.grad
        if self._compression is not Compression.none or grad.device.type != "cpu" or \
                not grad.is_contiguous() or grad.numel() == 0:
            return None
        comm = mpi_ops._comm(self._process_set)
        cached = self._prepared.get(p)
        if cached is None or cached[0].comm is not comm or cached[1] is not grad.dtype or \
                cached[2] != grad.shape:
            like = to_numpy(grad.detach(), "DistributedOptimizer")
            cached = (prepare_allreduce_(comm, self._names[p], like, self._op, **self._scale),
                      grad.dtype, grad.shape)
            self._prepared[p] = cached
        return cached[0].start(grad.data_ptr(), grad)

    def synchronize(self):
        """Wait until every parameter's gradient holds its reduction over all ranks.
        Parameters whose gradient did not arrive this step (on this rank) are reduced too,
        as zeros, so that every rank reduces the same tensors."""
        for p in self._names:
            if p.requires_grad and p not in self._pending:
                self._start_reduction(p)
        pending, self._pending = self._pending, {}
        failure = None
        for p, (handle, wire, ctx) in pending.items():
            try:
                mpi_ops.synchronize(handle)
            except Exception as e:  # wait for the others, then raise the first failure
                failure = failure or e
                continue
            if wire is not p.grad:
                with torch.no_grad():
                    p.grad.copy_(self._compression.decompress(wire, ctx))
        self._synchronized = True
        if failure is not None:
            raise failure

    def reset_pending(self):
        """Forget the reductions in flight, which a failed ring will never complete
        (elastic recovery calls this); the gradients keep whatever they hold."""
        self._pending = {}
        self._passes = {p: 0 for p in self._names}
        self._synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For step() after an explicit synchronize() (e.g. to clip averaged gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): gradients are reduced again",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        if self._pending:
            raise UsageError(
                f"optimizer.zero_grad() was called while {len(self._pending)} gradient "
                "reductions are pending; call step() or synchronize() first")
        self._optimizer.zero_grad(set_to_none=set_to_none)
