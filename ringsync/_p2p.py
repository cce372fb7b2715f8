"""Point-to-point messages between two ranks of a ring: Communicator's send and recv
(a mixin: it uses the Communicator's _rank, _size, _name, _start and synchronize)."""
import numpy as np

from ._arrays import as_input, as_output, describe
from ._native import lib
from ._requests import Call
from ._submit import Handle, make_request
from .errors import UsageError


class PointToPoint:
    def _peer(self, peer, what: str, role: str, name) -> int:
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or \
                not 0 <= int(peer) < self._size or int(peer) == self._rank:
            raise UsageError(f"ringsync.{what}: {role} rank {peer!r}{describe(name)} is out of "
                             f"range: not one of this ring's ranks 0..{self._size - 1} other "
                             f"than this rank ({self._rank})")
        return int(peer)

    def _message_name(self, name, what: str) -> str:
        """The caller's name, or "" (unnamed: matched by its place in the pair's order)."""
        return "" if name is None else self._name(name, what)

    def send_async(self, x, dst: int, name=None) -> Handle:
        """Start sending x to rank dst (of this ring: a process set's own numbering).
        synchronize returns None once dst has received it: a send completes only when the
        matching recv_async is posted (synchronous, like MPI_Ssend), so exchanges that
        send and receive at once use the async calls. Unnamed messages between a pair
        match in order (the k-th send from A to B meets the k-th unnamed recv on B from
        A); a named one meets the recv of the same name, in any order. x must not change
        until then."""
        dst = self._peer(dst, "send", "destination", name)
        src = as_input(x, "send", name)
        request = make_request("send", lib.RS_KIND_SEND, self._message_name(name, "send"), src,
                               None, root=dst)
        request.start_now = True  # nothing to fuse with: start the round now
        return self._start(Call([request], lambda: None, "send"))

    def recv_async(self, out, src: int, name=None) -> Handle:
        """Start receiving rank src's message into out (writable, C-contiguous, with the
        sender's dtype and shape: a mismatch fails both ends, naming both). synchronize
        returns out."""
        src_rank = self._peer(src, "recv", "source", name)
        buf = as_output(out, "recv", name)
        request = make_request("recv", lib.RS_KIND_RECV, self._message_name(name, "recv"), buf,
                               buf, root=src_rank)
        request.start_now = True
        return self._start(Call([request], lambda: buf, "recv"))

    def send(self, x, dst: int, name=None) -> None:
        """Send x to rank dst; returns once dst has received it (see send_async)."""
        return self.synchronize(self.send_async(x, dst, name))

    def recv(self, out, src: int, name=None):
        """Receive rank src's message into out; returns out's array."""
        return self.synchronize(self.recv_async(out, src, name))
