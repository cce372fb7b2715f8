"""The Work a ringsync process group returns, and the thread that completes it.

torch callers wait in two ways: `work.wait()` (dist.* calls, FSDP2) and
`work.get_future()` (DDP's reducer, which never calls wait(): its future must complete by
itself). So every asynchronous collective is handed to its group's Completer, a thread
that waits for the ringsync Handle in submission order and completes the future with the
output tensors, or with the error as torch's own DistBackendError; wait() then waits on
that future. A blocking call runs on the caller's thread and returns a Work already done.
"""
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ringsync.errors import MismatchError, RingsyncError, UsageError


def as_torch_error(exc: BaseException) -> BaseException:
    """What a torch caller catches: this rank's bad arguments stay a ValueError (as
    torch's own checks raise); a failed collective (a lost peer, a timeout, ranks that
    called different collectives) becomes torch's DistBackendError, a RuntimeError."""
    if not isinstance(exc, RingsyncError) or (isinstance(exc, UsageError) and
                                              not isinstance(exc, MismatchError)):
        return exc
    error = dist.DistBackendError(str(exc))
    error.__cause__ = exc
    return error


class RingsyncWork(dist.Work):
    """A collective of the ringsync backend: done when its future is."""

    def __init__(self, future: torch.futures.Future, source_rank: int = -1):
        super().__init__()
        self._future = future
        self._source = source_rank

    @classmethod
    def done(cls, value, source_rank: int = -1) -> "RingsyncWork":
        future = torch.futures.Future()
        future.set_result(value)
        return cls(future, source_rank)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._future.wait()  # (raises the collective's error, as gloo's wait does)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self.exception() is None if self._future.done() else False

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:  # (the error the collective failed with)
            return exc
        return None

    def result(self):
        return self._future.value()

    def _source_rank(self) -> int:
        return self._source

    source_rank = _source_rank


class Completer:
    """One thread per process group waits for the group's handles in the order they were
    started (the order ranks started them in) and completes their futures.

    Completing a future runs the callbacks chained on it (`then`) on this thread, and a
    callback may start a collective and wait for it (DDP's PowerSGD hook does): a
    collective started from the waiting thread itself hands the waiting over to a new
    thread, and the old one leaves once its callback returns, so that nothing waits for
    itself and the handles are still waited for one at a time, in order."""

    def __init__(self, name: str):
        self._name = name
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def add(self, wait, finish) -> RingsyncWork:
        """wait(): the handle's raw result (blocking); finish(raw): the output tensors."""
        future = torch.futures.Future()
        self._ensure_thread()
        self._queue.put((wait, finish, future))
        return RingsyncWork(future)

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or self._thread is threading.current_thread():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"ringsync-completer-{self._name}")
                self._thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            item = self._queue.get()
            if item is None:
                return
            wait, finish, future = item
            try:
                value = finish(wait())
            except BaseException as exc:  # (every waiter must hear of it)
                future.set_exception(as_torch_error(exc))
            else:
                future.set_result(value)
            if self._thread not in (me, None):  # (handed over from inside a callback)
                return
