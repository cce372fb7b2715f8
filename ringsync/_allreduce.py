"""The allreduce family of a Communicator: blocking (with the same-host lane's native
entry first), asynchronous, into given memory, and prepared once for many starts.

A mixin of Communicator, as _grouped.py is: it builds on what that class makes (_name,
_ring, _submitter)."""
import numpy as np

from ._native import lib
from ._requests import IN_PLACE, allreduce_buffers
from ._arrays import as_output
from ._submit import Handle, PreparedAllreduce
from .errors import MismatchError, UsageError
from .ops import ReduceOp, as_op


class AllreduceCollectives:

    def _allreduce_args(self, x, out, op, prescale, postscale, name, what, blocking):
        """(src, out, name, op code, prescale, postscale, what) of an allreduce, checked
        (out: see allreduce_buffers)."""
        try:  # (inline, not _checked: this is every allreduce's path)
            name = self._name(name, "allreduce")  # (a NUL in it is refused to the peers too)
            src, out = (as_output(x, what, name),) * 2 if out is IN_PLACE else \
                allreduce_buffers(x, out, what, name)  # (in place: the common case, inline)
            code, prescale, postscale = as_op(op, what), float(prescale), float(postscale)
        except (TypeError, ValueError) as exc:
            self._submitter.refuse([str(name)], lib.RS_KIND_ALLREDUCE, exc, blocking)
            raise
        return src, out, name, code, prescale, postscale, what

    # A blocking allreduce of a numpy array tries the same-host lane's native entry first
    # (ring.entry: the whole call in C, for requests the ordinary path has checked and
    # remembered there); whatever it does not take goes the ordinary way.

    def allreduce(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                  name=None):
        """x reduced over all ranks, in a new array."""
        if name is None:
            name = self._name(None, "allreduce")
        fast = self._ring.entry
        if fast is not None and type(x) is np.ndarray:
            out = np.empty(x.shape, x.dtype)
            done = fast.run(x, out, op, prescale_factor, postscale_factor, name)
            if done is out:
                return out
            if done is not None:
                return self._after_lane(done, x, None, op, prescale_factor, postscale_factor,
                                        name, "allreduce")
        return self._submitter.run_allreduce(self, *self._allreduce_args(
            x, None, op, prescale_factor, postscale_factor, name, "allreduce", True))

    def allreduce_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                   name=None):
        """Reduce x in place; returns x's array."""
        if name is None:
            name = self._name(None, "allreduce")  # (as every allreduce: mixed callers match)
        fast = self._ring.entry
        if fast is not None:
            done = fast.run(x, x, op, prescale_factor, postscale_factor, name)
            if done is x:
                return x
            if done is not None:
                return self._after_lane(done, x, IN_PLACE, op, prescale_factor,
                                        postscale_factor, name, "allreduce_")
        return self._submitter.run_allreduce(self, *self._allreduce_args(
            x, IN_PLACE, op, prescale_factor, postscale_factor, name, "allreduce_", True))

    def _after_lane(self, status, x, out, op, prescale, postscale, name, what):
        """The lane's native entry ended with `status`: an error (raised), or RS_OK where
        every rank found that the engine must run the call (it has been posted on the
        lane: it goes to the engine now, not to the lane again)."""
        if status != lib.RS_OK:
            self._submitter.raise_engine_error(status, what, name, MismatchError)
        return self._submitter.run_allreduce(self, *self._allreduce_args(
            x, out, op, prescale, postscale, name, what, True), lane=False)

    def allreduce_into(self, x, out, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                       postscale_factor=1.0, name=None):
        """allreduce() into memory the caller gives (out: a writable C-contiguous array of
        x's dtype and shape, not overlapping x); returns out. For adapters that hand the
        result to a framework which adopts only memory it likes (aligned, say)."""
        if out is None or out is IN_PLACE:
            raise UsageError("ringsync.allreduce_into: out must be an array")
        return self._submitter.run_allreduce(self, *self._allreduce_args(
            x, out, op, prescale_factor, postscale_factor, name, "allreduce", True))

    def allreduce_async(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                        name=None) -> Handle:
        """Start reducing x over all ranks into a new array; synchronize returns it."""
        return self._submitter.start_allreduce(self, *self._allreduce_args(
            x, None, op, prescale_factor, postscale_factor, name, "allreduce", False))

    def allreduce_async_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         name=None) -> Handle:
        """Start reducing x in place; synchronize returns x's array."""
        if name is None:
            name = self._name(None, "allreduce")  # (as every allreduce: mixed callers match)
        if type(x) is np.ndarray:  # (the native entry, as a batch of one)
            handle = self._submitter.start_batch(self, [x], [name], op, prescale_factor,
                                                 postscale_factor, "allreduce_", single=True)
            if handle is not None:
                return handle
        return self._submitter.start_allreduce(self, *self._allreduce_args(
            x, IN_PLACE, op, prescale_factor, postscale_factor, name, "allreduce_", False))

    def prepare_allreduce_(self, name: str, like, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                           postscale_factor=1.0) -> PreparedAllreduce:
        """Everything about an in-place allreduce on this communicator but the memory,
        checked once: prepared.start(address, keep) then submits it from the same request
        cache as every allreduce (a DistributedOptimizer starts every gradient of every
        step this way). like: an array with the tensor's dtype and shape."""
        like = np.asarray(like)
        return self._submitter.prepare_allreduce_(self, str(name), like,
                                                  as_op(op, "allreduce_"),
                                                  prescale_factor, postscale_factor)
