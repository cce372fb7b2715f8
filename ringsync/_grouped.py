"""The grouped collectives of a Communicator: a list of tensors as one unit, negotiated
together (one round) and fused together, so that a group starts only once every rank
has submitted all of it. Tensor i of a group named `base` travels as `base.i`.

A mixin of Communicator: it builds on the single-tensor requests that class makes
(_name, _checked, _run, _start) and on the request builders of _requests.py."""
import numpy as np

from ._arrays import as_input, as_output
from ._native import lib
from ._requests import Call, allgather_request, reducescatter_request
from ._submit import Handle, make_request
from .ops import ReduceOp, as_op


def _named(tensors, base: str):
    """The group as a list, and each tensor's name (made before any check: see _checked)."""
    tensors = list(tensors)
    return tensors, _member_names(base, len(tensors))


_NAMES_KEPT = 256  # groups whose member names are kept (a training loop repeats a few)
_member_names_kept = {}


def _member_names(base: str, n: int) -> list:
    """[base.0, ..., base.n-1], kept for the groups a loop repeats (a list the caller must
    not change)."""
    names = _member_names_kept.get((base, n))
    if names is None:
        if len(_member_names_kept) >= _NAMES_KEPT:
            _member_names_kept.clear()
        names = _member_names_kept[(base, n)] = [f"{base}.{i}" for i in range(n)]
    return names


def _allreduce_request(x, what, name, code, prescale, postscale, in_place, blocking):
    src = as_output(x, what, name) if in_place else as_input(x, what, name)
    out = src if in_place else np.empty_like(src)
    return make_request(what, lib.RS_KIND_ALLREDUCE, name, src, out, op=code, prescale=prescale,
                        postscale=postscale, reduces=True, blocking=blocking)


class GroupedCollectives:

    def _grouped_allreduce_call(self, tensors, op, prescale, postscale, name, in_place,
                                blocking, base=None):
        """base: the group's name, where the caller has made it already."""
        what = "grouped_allreduce_" if in_place else "grouped_allreduce"
        tensors, names = _named(tensors, base or self._name(name, "grouped_allreduce"))
        requests = self._checked(names, lib.RS_KIND_ALLREDUCE, blocking, lambda: [
            _allreduce_request(x, what, name, as_op(op, what), prescale, postscale, in_place,
                               blocking)
            for x, name in zip(tensors, names)])
        outs = [request.out for request in requests]
        return Call(requests, lambda: outs, what)

    def grouped_allreduce(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                          postscale_factor=1.0, name=None):
        """Reduce a list of tensors as one unit; returns the list of results."""
        return self._run(self._grouped_allreduce_call(
            tensors, op, prescale_factor, postscale_factor, name, False, True))

    def grouped_allreduce_(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                           postscale_factor=1.0, name=None):
        """Reduce a list of tensors in place, as one unit; returns their arrays."""
        return self._run(self._grouped_allreduce_call(
            tensors, op, prescale_factor, postscale_factor, name, True, True))

    def grouped_allreduce_async(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                postscale_factor=1.0, name=None) -> Handle:
        return self._start(self._grouped_allreduce_call(
            tensors, op, prescale_factor, postscale_factor, name, False, False))

    def grouped_allreduce_async_(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                 postscale_factor=1.0, name=None) -> Handle:
        base = self._name(name, "grouped_allreduce")
        if type(tensors) is list and tensors:  # (numpy arrays: the native entry, in one call)
            handle = self._start_batch(tensors, _member_names(base, len(tensors)), op,
                                       prescale_factor, postscale_factor,
                                       "grouped_allreduce_")
            if handle is not None:
                return handle
        return self._start(self._grouped_allreduce_call(
            tensors, op, prescale_factor, postscale_factor, name, True, False, base))

    def _grouped_allgather_call(self, tensors, name, blocking):
        tensors, names = _named(tensors, self._name(name, "grouped_allgather"))
        made = self._checked(names, lib.RS_KIND_ALLGATHER, blocking, lambda: [
            allgather_request(x, name, "grouped_allgather", blocking)
            for x, name in zip(tensors, names)])
        return Call([request for request, _ in made], lambda results: [
            finish(result) for (_, finish), result in zip(made, results)], "grouped_allgather",
            takes=True)

    def grouped_allgather(self, tensors, name=None):
        """Allgather a list of tensors as one unit; returns the list."""
        return self._run(self._grouped_allgather_call(tensors, name, True))

    def grouped_allgather_async(self, tensors, name=None) -> Handle:
        return self._start(self._grouped_allgather_call(tensors, name, False))

    def _grouped_reducescatter_call(self, tensors, op, prescale, postscale, name, blocking):
        tensors, names = _named(tensors, self._name(name, "grouped_reducescatter"))
        made = self._checked(names, lib.RS_KIND_REDUCESCATTER, blocking, lambda: [
            reducescatter_request(x, as_op(op, "grouped_reducescatter"), prescale, postscale,
                                  name, "grouped_reducescatter", blocking, self._rank,
                                  self._size)
            for x, name in zip(tensors, names)])
        outs = [out for _, out in made]
        return Call([request for request, _ in made], lambda: outs, "grouped_reducescatter")

    def grouped_reducescatter(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                              postscale_factor=1.0, name=None):
        """Reducescatter a list of tensors as one unit; returns the list."""
        return self._run(self._grouped_reducescatter_call(
            tensors, op, prescale_factor, postscale_factor, name, True))

    def grouped_reducescatter_async(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                    postscale_factor=1.0, name=None) -> Handle:
        return self._start(self._grouped_reducescatter_call(
            tensors, op, prescale_factor, postscale_factor, name, False))
