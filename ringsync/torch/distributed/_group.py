"""ProcessGroupRingsync: a torch.distributed process group whose collectives run on a
ringsync Communicator (one ring per group).

torch calls these methods by name, from Python (the dist.* functions) and from C++ (DDP's
reducer, functional collectives, FSDP2): the names and argument orders are torch's.
A call whose options say it is synchronous (async_op=False) runs the ring's blocking entry
point on the caller's thread (the same-host lane where it can); the others start a
ringsync Handle whose future the group's Completer completes (see _work.py).
"""
import collections
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from ringsync.errors import UsageError

from ._convert import BACKEND, Staged, reduce_bitwise, reduction
from ._work import Completer, RingsyncWork, as_torch_error


def _blocking(opts) -> bool:
    return opts is not None and not getattr(opts, "asyncOp", True)


def _op(opts):
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


def _async_name(method: str) -> str:
    """A Communicator method's asynchronous form: allreduce_ -> allreduce_async_."""
    return f"{method[:-1]}_async_" if method.endswith("_") else f"{method}_async"


def _one(tensors, what):
    if len(tensors) != 1:
        raise UsageError(f"{BACKEND} backend: {what} takes one tensor per rank, got "
                         f"{len(tensors)}")
    return tensors[0]


def _same_size(got: int, want: int, what: str, rank: int):
    if got != want:
        raise UsageError(f"{BACKEND} backend: {what} on rank {rank}: {got} elements where "
                         f"{want} are needed")


class ProcessGroupRingsync(dist.ProcessGroup):
    """The group's ranks, as torch numbers them (0..size-1), on one ringsync ring."""

    def __init__(self, comm, rank: int, size: int, timeout: timedelta, owns_comm: bool = True):
        super().__init__(rank, size)
        self.comm, self.timeout, self._owns_comm = comm, timeout, owns_comm
        self._names = {"group": "", "desc": ""}
        self._completer = Completer(f"rank{rank}")
        self._messages = collections.Counter()  # (direction, peer, tag) -> messages so far

    # ---- what torch asks of every group ----

    def getBackendName(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:  # (torch keeps a group's name on its backend: here)
        return self._names["group"]

    def setGroupName(self, name: str) -> None:
        self._names["group"] = name

    def getGroupDesc(self) -> str:
        return self._names["desc"]

    def setGroupDesc(self, desc: str) -> None:
        self._names["desc"] = desc

    def shutdown(self) -> None:
        """destroy_process_group(): every member shuts its groups down in the same order."""
        self._completer.stop()
        if self._owns_comm:
            self.comm.shutdown()

    def abort(self) -> None:
        self.comm.abort("torch.distributed aborted the process group")
        self._completer.stop()

    # ---- submitting ----

    def _submit(self, blocking: bool, method: str, args, kwargs, finish, what: str):
        """comm.<method>(*args) on this thread (blocking), or its asynchronous form with
        the Completer; finish turns the raw result into the Work's value."""
        comm = self.comm
        try:
            if blocking:
                return RingsyncWork.done(finish(getattr(comm, method)(*args, **kwargs)))
            handle = getattr(comm, _async_name(method))(*args, **kwargs)
        except Exception as exc:
            raise as_torch_error(exc) from None
        return self._completer.add(lambda: comm.synchronize(handle), finish)

    def _checked(self, collective: str, build):
        """build(): this rank's checks; one that fails refuses the call on the ring first,
        so that the peers' same call fails too instead of waiting for this rank."""
        try:
            return build()
        except (TypeError, ValueError) as exc:
            self.comm.refuse_call(collective, None, exc)
            raise

    # ---- allreduce and reduce ----

    def allreduce(self, tensors, opts=None):
        if len(tensors) > 1:
            return self.allreduce_coalesced(tensors, opts)
        staged = self._checked("allreduce", lambda: Staged(_one(tensors, "all_reduce"),
                                                            "all_reduce"))
        code, pre = self._checked("allreduce", lambda: reduction(_op(opts), staged.tensor,
                                                                 "all_reduce"))
        if code is None:
            return self._bitwise(staged, _op(opts).op, _blocking(opts), lambda: True, tensors)
        return self._submit(_blocking(opts), "allreduce_", (staged.array,),
                            dict(op=code, prescale_factor=pre),
                            lambda _: [staged.copy_back()], "all_reduce")

    def allreduce_coalesced(self, tensors, opts=None):
        staged = [Staged(t, "all_reduce_coalesced") for t in tensors]
        reductions = {reduction(_op(opts), s.tensor, "all_reduce_coalesced") for s in staged}
        code, pre = reductions.pop() if len(reductions) == 1 else (None, None)
        if code is None:
            raise UsageError(f"{BACKEND} backend: all_reduce_coalesced needs one "
                             f"non-bitwise reduction for all its tensors")
        return self._submit(_blocking(opts), "grouped_allreduce_", ([s.array for s in staged],),
                            dict(op=code, prescale_factor=pre),
                            lambda _: [s.copy_back() for s in staged], "all_reduce_coalesced")

    def _bitwise(self, staged, kind, blocking, keeps, value):
        """BAND/BOR/BXOR: every rank's tensor gathered, then reduced here (where keeps())."""
        size = self.size()

        def finish(gathered):
            if keeps():
                staged.fill(reduce_bitwise(kind, gathered, size))
            return value
        return self._submit(blocking, "allgather", (staged.array.reshape(1, -1),), {}, finish,
                            "all_reduce")

    def reduce(self, tensors, opts=None):
        staged = Staged(_one(tensors, "reduce"), "reduce")
        root, mine = opts.rootRank, self.rank()
        code, pre = reduction(_op(opts), staged.tensor, "reduce")
        if code is None:
            return self._bitwise(staged, _op(opts).op, _blocking(opts), lambda: mine == root,
                                 tensors)

        def finish(total):
            if mine == root:
                staged.fill(total)
            return tensors
        return self._submit(_blocking(opts), "allreduce", (staged.array,),
                            dict(op=code, prescale_factor=pre), finish, "reduce")

    # ---- broadcast ----

    def broadcast(self, tensors, opts=None):
        staged = [Staged(t, "broadcast") for t in tensors]
        root = opts.rootRank if opts is not None else 0
        if len(staged) == 1:
            return self._submit(_blocking(opts), "broadcast_", (staged[0].array, root), {},
                                lambda _: [staged[0].copy_back()], "broadcast")
        works = [self._submit(False, "broadcast_", (s.array, root), {},
                              lambda _, s=s: [s.copy_back()], "broadcast") for s in staged]
        return self._completer.add(lambda: [w.wait() for w in works], lambda _: tensors)

    # ---- allgather and gather ----

    def allgather(self, output_lists, inputs, opts=None):
        staged = Staged(_one(inputs, "all_gather"), "all_gather")
        outs = [Staged(o, "all_gather") for o in _one(output_lists, "all_gather")]
        _same_size(len(outs), self.size(), "all_gather: output tensors", self.rank())
        n = staged.array.size

        def finish(gathered):
            _same_size(gathered.size, n * len(outs), "all_gather: gathered elements",
                       self.rank())
            for i, out in enumerate(outs):
                out.fill(gathered.reshape(-1)[i * n:(i + 1) * n])
            return output_lists
        return self._submit(_blocking(opts), "allgather", (staged.array.reshape(-1),), {},
                            finish, "all_gather")

    def all_gather_single(self, output, input, opts=None):
        staged, out = Staged(input, "all_gather_into_tensor"), Staged(output,
                                                                        "all_gather_into_tensor")
        _same_size(out.array.size, staged.array.size * self.size(),
                   "all_gather_into_tensor: output", self.rank())
        return self._submit(_blocking(opts), "allgather", (staged.array.reshape(-1),), {},
                            lambda gathered: [out.fill(gathered)], "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        staged = [Staged(t, "all_gather_into_tensor_coalesced") for t in inputs]
        outs = [Staged(t, "all_gather_into_tensor_coalesced") for t in outputs]
        return self._submit(_blocking(opts), "grouped_allgather",
                            ([s.array.reshape(-1) for s in staged],), {},
                            lambda got: [o.fill(g) for o, g in zip(outs, got)],
                            "all_gather_into_tensor_coalesced")

    def gather(self, output_lists, inputs, opts=None):
        """Every rank sends its tensor to the root only (an alltoall with one split)."""
        staged = Staged(_one(inputs, "gather"), "gather")
        root, size = opts.rootRank, self.size()
        outs = [Staged(o, "gather") for o in output_lists[0]] if self.rank() == root else []
        splits = [0] * size
        splits[root] = staged.array.size

        def finish(got):
            data, from_each = got
            at = 0
            for rank, out in enumerate(outs):
                _same_size(int(from_each[rank]), out.array.size, f"gather: from rank {rank}",
                           self.rank())
                out.fill(data[at:at + out.array.size])
                at += out.array.size
            return output_lists
        return self._submit(_blocking(opts), "alltoall", (staged.array.reshape(-1), splits), {},
                            finish, "gather")

    # ---- reduce-scatter and scatter ----

    def reduce_scatter(self, outputs, input_lists, opts=None):
        out = Staged(_one(outputs, "reduce_scatter"), "reduce_scatter")
        ins = [Staged(t, "reduce_scatter") for t in _one(input_lists, "reduce_scatter")]
        _same_size(len(ins), self.size(), "reduce_scatter: input tensors", self.rank())
        for s in ins:
            _same_size(s.array.size, out.array.size, "reduce_scatter: an input", self.rank())
        stacked = np.concatenate([s.array.reshape(1, -1) for s in ins])
        return self._reduce_scatter(stacked, out, opts, "reduce_scatter", outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        out, staged = Staged(output, "reduce_scatter_tensor"), Staged(input,
                                                                       "reduce_scatter_tensor")
        _same_size(staged.array.size, out.array.size * self.size(),
                   "reduce_scatter_tensor: input", self.rank())
        return self._reduce_scatter(staged.array.reshape(self.size(), -1), out, opts,
                                    "reduce_scatter_tensor", [output])

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, rows, out, opts, what, value):
        code, pre = reduction(_op(opts), out.tensor, what)
        if code is None:
            raise UsageError(f"{BACKEND} backend: {what} has no bitwise reductions")
        return self._submit(_blocking(opts), "reducescatter", (rows,),
                            dict(op=code, prescale_factor=pre),
                            lambda mine: (out.fill(mine), value)[1], what)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        outs = [Staged(t, "reduce_scatter_tensor_coalesced") for t in outputs]
        ins = [Staged(t, "reduce_scatter_tensor_coalesced") for t in inputs]
        code, pre = reduction(_op(opts), outs[0].tensor, "reduce_scatter_tensor_coalesced")
        if code is None:
            raise UsageError(f"{BACKEND} backend: reduce_scatter_tensor_coalesced has no "
                             f"bitwise reductions")
        rows = [s.array.reshape(self.size(), -1) for s in ins]
        return self._submit(_blocking(opts), "grouped_reducescatter", (rows,),
                            dict(op=code, prescale_factor=pre),
                            lambda got: [o.fill(g) for o, g in zip(outs, got)],
                            "reduce_scatter_tensor_coalesced")

    def scatter(self, outputs, input_lists, opts=None):
        """The root sends tensor i to rank i (an alltoall where only the root sends)."""
        out = Staged(_one(outputs, "scatter"), "scatter")
        root, size = opts.rootRank, self.size()
        if self.rank() == root:
            ins = [Staged(t, "scatter") for t in _one(input_lists, "scatter")]
            _same_size(len(ins), size, "scatter: input tensors", self.rank())
            data = np.concatenate([s.array.reshape(-1) for s in ins])
            splits = [s.array.size for s in ins]
        else:
            data, splits = np.empty(0, out.array.dtype), [0] * size

        def finish(got):
            received, _ = got
            _same_size(received.size, out.array.size, "scatter: received", self.rank())
            return [out.fill(received)]
        return self._submit(_blocking(opts), "alltoall", (data, splits), {}, finish, "scatter")

    # ---- all-to-all ----

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        staged, out = Staged(input, "all_to_all_single"), Staged(output, "all_to_all_single")
        size = self.size()
        rows = staged.tensor.shape[0] if staged.tensor.dim() else 1
        if input_split_sizes:
            splits = list(input_split_sizes)
        elif rows % size:
            raise UsageError(f"{BACKEND} backend: all_to_all_single on rank {self.rank()}: "
                             f"{rows} rows do not split evenly over {size} ranks")
        else:
            splits = [rows // size] * size
        wanted = list(output_split_sizes) if output_split_sizes else None

        def finish(got):
            data, from_each = got
            if wanted is not None and [int(r) for r in from_each] != wanted:
                raise UsageError(f"{BACKEND} backend: all_to_all_single on rank "
                                 f"{self.rank()}: received rows {list(map(int, from_each))}, "
                                 f"output_split_sizes {wanted}")
            _same_size(data.size, out.array.size, "all_to_all_single: output", self.rank())
            return [out.fill(data)]
        return self._submit(_blocking(opts), "alltoall",
                            (staged.array.reshape(max(rows, 1), -1), splits), {}, finish,
                            "all_to_all_single")

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        ins = [Staged(t, "all_to_all") for t in inputs]
        outs = [Staged(t, "all_to_all") for t in outputs]
        _same_size(len(ins), self.size(), "all_to_all: input tensors", self.rank())
        data = np.concatenate([s.array.reshape(-1) for s in ins])

        def finish(got):
            received, from_each = got
            at = 0
            for rank, out in enumerate(outs):
                _same_size(int(from_each[rank]), out.array.size,
                           f"all_to_all: from rank {rank}", self.rank())
                out.fill(received[at:at + out.array.size])
                at += out.array.size
            return outputs
        return self._submit(_blocking(opts), "alltoall", (data, [s.array.size for s in ins]),
                            {}, finish, "all_to_all")

    # ---- barrier and messages ----

    def barrier(self, opts=None):
        try:
            self.comm.barrier()
        except Exception as exc:
            raise as_torch_error(exc) from None
        return RingsyncWork.done([])

    def _message_name(self, direction: str, src: int, dst: int, tag: int) -> str:
        """Messages of one pair and tag meet in order (torch's rule): the k-th send from
        src to dst with a tag is the k-th recv on dst from src with it."""
        peer = dst if direction == "send" else src
        key = (direction, peer, int(tag))
        k = self._messages[key]
        self._messages[key] = k + 1
        return f"torch.p2p.{src}.{dst}.{int(tag)}.{k}"

    def send(self, tensors, dst: int, tag: int = 0):
        staged = Staged(_one(tensors, "send"), "send")
        name = self._message_name("send", self.rank(), dst, tag)
        return self._submit(False, "send", (staged.array, dst), dict(name=name),
                            lambda _: tensors, "send")

    def recv(self, tensors, src: int, tag: int = 0):
        staged = Staged(_one(tensors, "recv"), "recv")
        name = self._message_name("recv", src, self.rank(), tag)
        work = self._submit(False, "recv", (staged.array, src), dict(name=name),
                            lambda _: [staged.copy_back()], "recv")
        work._source = src
        return work

    def recv_anysource(self, tensors, tag: int = 0):
        raise UsageError(f"{BACKEND} backend: recv from any source (src=None) is not "
                         f"supported: name the source rank")

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch's dist.monitored_barrier accepts only gloo; called on the group itself,
        this is a barrier whose failure names the ranks that did not come (ringsync's
        stall report and timeout say which)."""
        return self.barrier()

    def __repr__(self):
        return (f"ProcessGroupRingsync(rank={self.rank()}, size={self.size()}, "
                f"name={self._names['group']!r})")
