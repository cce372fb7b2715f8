"""The collectives of a ringsync process group, under the names and argument orders torch
calls them by (from Python's dist.* functions and from C++: DDP's reducer, functional
collectives, FSDP2). Each checks this rank's arguments, turns tensors into what the ring
takes (see _convert.py) and hands the call to the group's road (`_start`, in _group.py).
"""
import numpy as np
import torch.distributed as dist

from ringsync.errors import UsageError

from ._convert import BACKEND, BITWISE, Staged, reduce_bitwise, reduction


def _blocking(opts) -> bool:
    """Whether torch waits for the call at once (async_op=False)."""
    return opts is not None and not getattr(opts, "asyncOp", True)


def _op(opts):
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


def _one(tensors, what):
    if len(tensors) != 1:
        raise UsageError(f"{BACKEND} backend: {what} takes one tensor per rank, got "
                         f"{len(tensors)}")
    return tensors[0]


def _nbytes(tensors) -> int:
    """The bytes of a call's one tensor, as the peers see theirs (-1: none to see)."""
    t = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else None
    return t.numel() * t.element_size() if hasattr(t, "element_size") else -1


def _same_size(got: int, want: int, what: str, rank: int, unit: str = "elements"):
    if got != want:
        raise UsageError(f"{BACKEND} backend: {what} on rank {rank}: {got} {unit} where "
                         f"{want} are needed")


def _fill_from_each(outs, got, what: str, rank: int) -> None:
    """An alltoall's result (data, elements from each rank) into outs, rank by rank."""
    data, from_each = got
    at = 0
    for peer, out in enumerate(outs):
        _same_size(int(from_each[peer]), out.array.size, f"{what}: from rank {peer}", rank)
        out.fill(data[at:at + out.array.size])
        at += out.array.size


def _splits(given, rows: int, side: str, rank: int, size: int):
    """all_to_all_single's rows to or from each rank: given, or an even split."""
    if given:
        splits = [int(n) for n in given]
        _same_size(len(splits), size, f"all_to_all_single: {side}_split_sizes", rank,
                   "sizes")
        _same_size(sum(splits), rows, f"all_to_all_single: {side}_split_sizes", rank, "rows")
        return splits
    if rows % size:
        raise UsageError(f"{BACKEND} backend: all_to_all_single on rank {rank}: {rows} "
                         f"{side} rows do not split evenly over {size} ranks")
    return [rows // size] * size


def _scattering_reduction(opts, tensor, what):
    code, pre = reduction(_op(opts), tensor, what)
    if code is None:
        raise UsageError(f"{BACKEND} backend: {what} has no bitwise reductions")
    return code, pre



class Collectives:
    """allreduce ... alltoall: a mixin of ProcessGroupRingsync (its _start, _refuse,
    _completer, comm, rank() and size())."""

    # ---- allreduce and reduce ----

    def allreduce(self, tensors, opts=None):
        if len(tensors) > 1:
            return self.allreduce_coalesced(tensors, opts)
        return self._reduce(tensors, opts, "all_reduce", keeps=lambda: True)

    def reduce(self, tensors, opts=None):
        root, mine = opts.rootRank, self.rank()
        return self._reduce(tensors, opts, "reduce", keeps=lambda: mine == root)

    def _reduce(self, tensors, opts, what, keeps):
        """all_reduce, or reduce (keeps(): whether this rank takes the result); a bitwise
        op is reduced here from every rank's tensor (an allgather)."""
        op = _op(opts)
        try:
            staged = Staged(_one(tensors, what), what)
            code, pre = reduction(op, staged.tensor, what)
        except (TypeError, ValueError) as exc:  # (bitwise or not: the peers' call says)
            self._refuse("allgather" if getattr(op, "op", op) in BITWISE else "allreduce",
                         exc, _blocking(opts), nbytes=_nbytes(tensors))
            raise

        def finish_bitwise(gathered):
            if keeps():
                staged.fill(reduce_bitwise(op.op, gathered, self.size()))
            return tensors

        def finish(total):
            if keeps():
                staged.fill(total)
            return tensors
        if code is None:
            return self._start(opts, "allgather", lambda: (
                (staged.array.reshape(1, -1),), {}, finish_bitwise))
        if what == "all_reduce":  # (in place)
            return self._start(opts, "allreduce_", lambda: (
                (staged.array,), dict(op=code, prescale_factor=pre),
                lambda _: [staged.copy_back()]))
        return self._start(opts, "allreduce", lambda: (
            (staged.array,), dict(op=code, prescale_factor=pre), finish))

    def allreduce_coalesced(self, tensors, opts=None):
        def build():
            staged = [Staged(t, "all_reduce_coalesced") for t in tensors]
            reductions = {reduction(_op(opts), s.tensor, "all_reduce_coalesced")
                          for s in staged}
            if len(reductions) != 1 or next(iter(reductions))[0] is None:
                raise UsageError(f"{BACKEND} backend: all_reduce_coalesced needs one "
                                 f"non-bitwise reduction for all its tensors")
            code, pre = reductions.pop()
            return (([s.array for s in staged],), dict(op=code, prescale_factor=pre),
                    lambda _: [s.copy_back() for s in staged])
        return self._start(opts, "grouped_allreduce_", build, count=len(tensors))

    # ---- broadcast ----

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        if len(tensors) == 1:
            return self._broadcast_one(tensors[0], root, opts)
        works = [self._broadcast_one(t, root, None) for t in tensors]
        return self._completer.add(lambda: [w.wait() for w in works], lambda _: tensors)

    def _broadcast_one(self, tensor, root, opts):
        def build():
            staged = Staged(tensor, "broadcast")
            return (staged.array, root), {}, lambda _: [staged.copy_back()]
        return self._start(opts, "broadcast_", build)

    # ---- allgather and gather ----

    def allgather(self, output_lists, inputs, opts=None):
        def build():
            staged = Staged(_one(inputs, "all_gather"), "all_gather")
            outs = [Staged(o, "all_gather") for o in _one(output_lists, "all_gather")]
            _same_size(len(outs), self.size(), "all_gather: output tensors", self.rank(),
                       "tensors")
            n = staged.array.size
            for out in outs:
                _same_size(out.array.size, n, "all_gather: an output tensor", self.rank())

            def finish(gathered):
                for i, out in enumerate(outs):
                    out.fill(gathered.reshape(-1)[i * n:(i + 1) * n])
                return output_lists
            return (staged.array.reshape(-1),), {}, finish
        return self._start(opts, "allgather", build)

    def all_gather_single(self, output, input, opts=None):
        def build():
            staged = Staged(input, "all_gather_into_tensor")
            out = Staged(output, "all_gather_into_tensor")
            _same_size(out.array.size, staged.array.size * self.size(),
                       "all_gather_into_tensor: output", self.rank())
            return (staged.array.reshape(-1),), {}, lambda gathered: [out.fill(gathered)]
        return self._start(opts, "allgather", build)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "all_gather_into_tensor_coalesced"

        def build():
            staged = [Staged(t, what) for t in inputs]
            outs = [Staged(t, what) for t in outputs]
            _same_size(len(outs), len(staged), f"{what}: output tensors", self.rank())
            for s, o in zip(staged, outs):
                _same_size(o.array.size, s.array.size * self.size(), f"{what}: an output",
                           self.rank())
            return (([s.array.reshape(-1) for s in staged],), {},
                    lambda got: [o.fill(g) for o, g in zip(outs, got)])
        return self._start(opts, "grouped_allgather", build, count=len(inputs))

    def gather(self, output_lists, inputs, opts=None):
        """Every rank sends its tensor to the root only (an alltoall with one split)."""
        root, size = opts.rootRank, self.size()

        def build():
            staged = Staged(_one(inputs, "gather"), "gather")
            outs = [Staged(o, "gather") for o in _one(output_lists, "gather")] \
                if self.rank() == root else []
            if outs:
                _same_size(len(outs), size, "gather: output tensors", self.rank(), "tensors")
            splits = [0] * size
            splits[root] = staged.array.size
            return (staged.array.reshape(-1), splits), {}, lambda got: (
                _fill_from_each(outs, got, "gather", self.rank()), output_lists)[1]
        return self._start(opts, "alltoall", build)

    # ---- reduce-scatter and scatter ----

    def reduce_scatter(self, outputs, input_lists, opts=None):
        def build():
            out = Staged(_one(outputs, "reduce_scatter"), "reduce_scatter")
            ins = [Staged(t, "reduce_scatter") for t in _one(input_lists, "reduce_scatter")]
            _same_size(len(ins), self.size(), "reduce_scatter: input tensors", self.rank(),
                       "tensors")
            for s in ins:
                _same_size(s.array.size, out.array.size, "reduce_scatter: an input",
                           self.rank())
            rows = np.concatenate([s.array.reshape(1, -1) for s in ins])
            return self._reduce_scatter_args(rows, out, opts, "reduce_scatter", outputs)
        return self._start(opts, "reducescatter", build)

    def reduce_scatter_single(self, output, input, opts=None):
        def build():
            out = Staged(output, "reduce_scatter_tensor")
            staged = Staged(input, "reduce_scatter_tensor")
            _same_size(staged.array.size, out.array.size * self.size(),
                       "reduce_scatter_tensor: input", self.rank())
            return self._reduce_scatter_args(staged.array.reshape(self.size(), -1), out,
                                             opts, "reduce_scatter_tensor", [output])
        return self._start(opts, "reducescatter", build)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_args(self, rows, out, opts, what, value):
        code, pre = _scattering_reduction(opts, out.tensor, what)
        return (rows,), dict(op=code, prescale_factor=pre), \
            lambda mine: (out.fill(mine), value)[1]

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "reduce_scatter_tensor_coalesced"

        def build():
            outs, ins = [Staged(t, what) for t in outputs], [Staged(t, what) for t in inputs]
            _same_size(len(outs), len(ins), f"{what}: output tensors", self.rank())
            for s, o in zip(ins, outs):
                _same_size(s.array.size, o.array.size * self.size(), f"{what}: an input",
                           self.rank())
            code, pre = _scattering_reduction(opts, outs[0].tensor, what)
            return (([s.array.reshape(self.size(), -1) for s in ins],),
                    dict(op=code, prescale_factor=pre),
                    lambda got: [o.fill(g) for o, g in zip(outs, got)])
        return self._start(opts, "grouped_reducescatter", build, count=len(inputs))

    def scatter(self, outputs, input_lists, opts=None):
        """The root sends tensor i to rank i (an alltoall where only the root sends)."""
        root, size = opts.rootRank, self.size()

        def build():
            out = Staged(_one(outputs, "scatter"), "scatter")
            if self.rank() == root:
                ins = [Staged(t, "scatter") for t in _one(input_lists, "scatter")]
                _same_size(len(ins), size, "scatter: input tensors", self.rank(), "tensors")
                for s in ins:
                    _same_size(s.array.size, out.array.size, "scatter: an input",
                               self.rank())
                data = np.concatenate([s.array.reshape(-1) for s in ins])
                splits = [s.array.size for s in ins]
            else:
                data, splits = np.empty(0, out.array.dtype), [0] * size

            def finish(got):
                received, _ = got
                _same_size(received.size, out.array.size, "scatter: received", self.rank())
                return [out.fill(received)]
            return (data, splits), {}, finish
        return self._start(opts, "alltoall", build)

    # ---- all-to-all ----

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        def build():
            staged = Staged(input, "all_to_all_single")
            out = Staged(output, "all_to_all_single")
            rows = staged.tensor.shape[0] if staged.tensor.dim() else 1
            out_rows = out.tensor.shape[0] if out.tensor.dim() else 1
            splits = _splits(input_split_sizes, rows, "input", self.rank(), self.size())
            wanted = _splits(output_split_sizes, out_rows, "output", self.rank(), self.size())

            def finish(got):
                data, from_each = got
                if [int(r) for r in from_each] != wanted:
                    raise UsageError(f"{BACKEND} backend: all_to_all_single on rank "
                                     f"{self.rank()}: received rows "
                                     f"{list(map(int, from_each))}, output rows {wanted}")
                return [out.fill(data)]
            return (staged.array.reshape(max(rows, 1), -1), splits), {}, finish
        return self._start(opts, "alltoall", build)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        def build():
            ins = [Staged(t, "all_to_all") for t in inputs]
            outs = [Staged(t, "all_to_all") for t in outputs]
            for side, staged in (("input", ins), ("output", outs)):
                _same_size(len(staged), self.size(), f"all_to_all: {side} tensors",
                           self.rank(), "tensors")
            data = np.concatenate([s.array.reshape(-1) for s in ins])
            return (data, [s.array.size for s in ins]), {}, lambda got: (
                _fill_from_each(outs, got, "all_to_all", self.rank()), outputs)[1]
        return self._start(opts, "alltoall", build)
