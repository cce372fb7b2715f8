"""The grouped collectives of a Communicator: a list of tensors as one unit, negotiated
together (one round) and fused together, so that a group starts only once every rank
has submitted all of it. Tensor i of a group named `base` travels as `base.i`.

A mixin of Communicator: it builds on the single-tensor requests that class makes
(_name, _submit, _submit_taking, _allgather_request, _reducescatter_request)."""
import numpy as np

from ._arrays import as_input, as_output
from ._native import lib
from ._submit import Handle, make_request
from .ops import ReduceOp, as_op


def _named(tensors, base: str):
    """The group as a list, and each tensor's name (made before any check: see _checked)."""
    tensors = list(tensors)
    return tensors, [f"{base}.{i}" for i in range(len(tensors))]


def _allreduce_request(x, what, name, code, prescale, postscale, in_place, blocking):
    src = as_output(x, what, name) if in_place else as_input(x, what, name)
    out = src if in_place else np.empty_like(src)
    return make_request(what, lib.RS_KIND_ALLREDUCE, name, src, out, op=code, prescale=prescale,
                        postscale=postscale, reduces=True, blocking=blocking)


class GroupedCollectives:

    def grouped_allreduce_async(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                postscale_factor=1.0, name=None, _in_place=False,
                                _blocking=False) -> Handle:
        """Reduce a list of tensors as one unit; synchronize returns the list of results."""
        what = "grouped_allreduce_" if _in_place else "grouped_allreduce"
        tensors, names = _named(tensors, self._name(name, "grouped_allreduce"))
        requests = self._checked(names, lib.RS_KIND_ALLREDUCE, _blocking, lambda: [
            _allreduce_request(x, what, name, as_op(op, what), prescale_factor,
                               postscale_factor, _in_place, _blocking)
            for x, name in zip(tensors, names)])
        outs = [request.out for request in requests]
        return self._submit(requests, lambda: outs, what)

    def grouped_allreduce_async_(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                 postscale_factor=1.0, name=None) -> Handle:
        return self.grouped_allreduce_async(tensors, op, prescale_factor, postscale_factor, name,
                                            _in_place=True)

    def grouped_allreduce(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                          postscale_factor=1.0, name=None):
        return self.synchronize(self.grouped_allreduce_async(
            tensors, op, prescale_factor, postscale_factor, name, _blocking=True))

    def grouped_allreduce_(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                           postscale_factor=1.0, name=None):
        return self.synchronize(self.grouped_allreduce_async(
            tensors, op, prescale_factor, postscale_factor, name, _in_place=True, _blocking=True))

    def grouped_allgather_async(self, tensors, name=None, _blocking=False) -> Handle:
        """Allgather a list of tensors as one unit; synchronize returns the list."""
        tensors, names = _named(tensors, self._name(name, "grouped_allgather"))
        made = self._checked(names, lib.RS_KIND_ALLGATHER, _blocking, lambda: [
            self._allgather_request(x, name, "grouped_allgather", _blocking)
            for x, name in zip(tensors, names)])
        return self._submit_taking([request for request, _ in made], lambda results: [
            finish(result) for (_, finish), result in zip(made, results)], "grouped_allgather")

    def grouped_allgather(self, tensors, name=None):
        return self.synchronize(self.grouped_allgather_async(tensors, name, _blocking=True))

    def grouped_reducescatter_async(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                    postscale_factor=1.0, name=None, _blocking=False) -> Handle:
        """Reducescatter a list of tensors as one unit; synchronize returns the list."""
        tensors, names = _named(tensors, self._name(name, "grouped_reducescatter"))
        made = self._checked(names, lib.RS_KIND_REDUCESCATTER, _blocking, lambda: [
            self._reducescatter_request(x, as_op(op, "grouped_reducescatter"), prescale_factor,
                                        postscale_factor, name, "grouped_reducescatter",
                                        _blocking)
            for x, name in zip(tensors, names)])
        outs = [out for _, out in made]
        return self._submit([request for request, _ in made], lambda: outs,
                            "grouped_reducescatter")

    def grouped_reducescatter(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                              postscale_factor=1.0, name=None):
        return self.synchronize(self.grouped_reducescatter_async(
            tensors, op, prescale_factor, postscale_factor, name, _blocking=True))
