"""ProcessGroupRingsync: a torch.distributed process group whose collectives run on a
ringsync Communicator (one ring per group).

torch calls these methods by name, from Python (the dist.* functions) and from C++ (DDP's
reducer, functional collectives, FSDP2): the names and argument orders are torch's.
torch matches a group's collectives in the order ranks issue them, whether a rank waits
for one (async_op=False) or not: DDP's join, for one, has a joined rank make blocking
all_reduces that match the others' asynchronous ones. A call that waits runs the ring's
blocking entry point on the caller's thread (the same-host lane, where ranks' calls meet
in order, so that ranks making different calls all fail naming both); so does a small
allreduce (up to one round of the lane) whether torch waits or not, and returns a Work
already done. Other asynchronous calls start a ringsync Handle, matched by name (the
names the ring gives unnamed calls, in call order), whose future the group's Completer
completes (see _work.py).
"""
import collections
from datetime import timedelta

import torch.distributed as dist

from ringsync.errors import UsageError

from ._collectives import Collectives, _blocking, _one
from ._convert import BACKEND, Staged
from ._devices import forward_cuda_to_nccl
from ._work import Completer, RingsyncWork, as_torch_error


# Allreduces up to this size run on the caller's thread where the ring has the same-host
# lane (one round of it, as the lane's own RS_LANE_MAX_BYTES): waiting there costs less
# than handing the call to the engine and the Completer.
ON_CALLER_MAX_BYTES = 256 << 10


def _async_name(method: str) -> str:
    """A Communicator method's asynchronous form: allreduce_ -> allreduce_async_."""
    return f"{method[:-1]}_async_" if method.endswith("_") else f"{method}_async"


@forward_cuda_to_nccl
class ProcessGroupRingsync(Collectives, dist.ProcessGroup):
    """The group's ranks, as torch numbers them (0..size-1), on one ringsync ring (and,
    where given, an NCCL backend for their CUDA tensors: see _devices.py)."""

    def __init__(self, comm, rank: int, size: int, timeout: timedelta, owns_comm: bool = True,
                 cuda=None):
        super().__init__(rank, size)
        self.comm, self.timeout, self._owns_comm = comm, timeout, owns_comm
        self.cuda, self._shut = cuda, False
        self._names = {"group": "", "desc": ""}
        self._completer = Completer(f"rank{rank}")
        self._messages = collections.Counter()  # (direction, peer, tag) -> messages so far
        # Allreduces up to this many bytes run on the caller's thread (see the top).
        self._on_caller_bytes = min(comm.config.lane_bytes, ON_CALLER_MAX_BYTES) \
            if comm.uses_lane else -1

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
        """destroy_process_group(): every member shuts its groups down in the same order
        (or, for the groups left, the exit: see __init__.py)."""
        if self._shut:
            return
        self._shut = True
        self._completer.stop()
        if self.cuda is not None:
            self.cuda.shutdown()
        if self._owns_comm:
            self.comm.shutdown()

    def abort(self) -> None:
        self.comm.abort("torch.distributed aborted the process group")
        self._completer.stop()
        if self.cuda is not None:
            self.cuda.abort()

    # ---- submitting ----

    def _start(self, opts, method: str, build, count=None, nbytes=-1):
        """One collective: build() checks this rank's arguments and returns (args, kwargs,
        finish); comm.<method>(*args, **kwargs) then runs (see _submit) and finish turns
        the raw result into the Work's value. A check that fails here refuses the call on
        the ring, as the peers make it, so that their same call fails too instead of
        waiting for this rank; count: the number of tensors of a grouped call; nbytes:
        the size of an allreduce's tensor (its road)."""
        blocking = _blocking(opts)
        try:
            args, kwargs, finish = build()
        except (TypeError, ValueError) as exc:
            self._refuse(method, exc, blocking, count, nbytes)
            raise
        return self._submit(blocking, method, args, kwargs, finish)

    def _on_caller(self, blocking: bool, method: str, nbytes: int) -> bool:
        """Whether the call runs on the caller's thread (see the top)."""
        return blocking or (method.startswith("allreduce") and
                            0 <= nbytes <= self._on_caller_bytes)

    def _refuse(self, method: str, exc: Exception, blocking: bool, count=None,
                nbytes=-1) -> None:
        self.comm.refuse_call(method.rstrip("_"), None, exc, count,
                              blocking=self._on_caller(blocking, method, nbytes))

    def _submit(self, blocking: bool, method: str, args, kwargs, finish):
        comm = self.comm
        try:
            if self._on_caller(blocking, method, getattr(args[0], "nbytes", -1)):
                return RingsyncWork.done(finish(getattr(comm, method)(*args, **kwargs)))
            handle = getattr(comm, _async_name(method))(*args, **kwargs)
        except Exception as exc:
            raise as_torch_error(exc) from None
        return self._completer.add(lambda: comm.synchronize(handle), finish)

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
                            lambda _: tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        staged = Staged(_one(tensors, "recv"), "recv")
        name = self._message_name("recv", src, self.rank(), tag)
        work = self._submit(False, "recv", (staged.array, src), dict(name=name),
                            lambda _: [staged.copy_back()])
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
