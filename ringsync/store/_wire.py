"""The store's wire: constants, framing (ringsync.store's docstring tells the protocol),
the payload codec, and what add and compare_set mean (torch's semantics) for both stores."""
import contextlib
import datetime
import hashlib
import hmac
import math
import re
import socket
import struct
import time
from typing import List, Optional, Tuple

from ..errors import CommunicationError, UsageError

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 16 << 20
MIN_SECRET_CHARS = 16

NONCE_BYTES = 32
TAG_BYTES = 32
FRAME_HEADER = struct.Struct(">IQ")  # payload length, sequence number
# What a request holds besides its one value (op, field lengths, a key, integers).
FRAME_OVERHEAD = MAX_KEY_BYTES + 64
HELLO_LIMIT = 4096  # the server's first frame, read before its value limit is known

CLIENT_PROOF = b"ringsync-store client"
SERVER_PROOF = b"ringsync-store server"
SESSION_KEY = b"ringsync-store session"
TO_SERVER, TO_CLIENT = b"\x01", b"\x02"  # the direction byte in every frame's tag

# Requests (the first byte of a client's payload).
OP_SET, OP_GET, OP_ADD, OP_CHECK, OP_DELETE, OP_COMPARE_SET, OP_WAIT, OP_HOLD = range(1, 9)
# Replies (the first byte of a server's payload).
ST_OK, ST_TIMEOUT, ST_REFUSED, ST_HELLO = range(4)

_ANSWER_GRACE_SECONDS = 10.0  # how much longer than a request's own wait a client waits
_PEER_CHECK_SECONDS = 0.25  # how often a waiting server thread looks at its client
_MAX_SECONDS = 1e7  # longer timeouts are clamped (sockets and conditions overflow)
_COUNTER = re.compile(rb"-?[0-9]{1,19}\Z")  # a counter as add() stores it (torch's too)
_INT64 = (-(1 << 63), (1 << 63) - 1)


# --- shared helpers -------------------------------------------------------------------

class _Malformed(CommunicationError):
    """A frame or payload that breaks the protocol: the server drops the connection; to a
    client it is a broken connection (a CommunicationError) too."""


class _Closed(ConnectionError):
    """The peer closed the connection (EOF)."""


class _Refused(Exception):
    """A well-formed request the store will not do (a limit, a value that is no counter):
    answered with an error, the store unchanged."""


def _mac(key: bytes, *parts) -> bytes:
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


def _check_secret(secret) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise UsageError("ringsync: a store needs the job's secret as non-empty bytes "
                         "(see load_secret)")
    return bytes(secret)


def _seconds(timeout) -> float:
    """A timedelta or a number of seconds, as clamped float seconds."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
        raise UsageError(f"ringsync: a store timeout is a timedelta or seconds, not "
                         f"{timeout!r}")
    return min(max(float(timeout), 0.0), _MAX_SECONDS)


def _key_bytes(key) -> bytes:
    if not isinstance(key, str):
        raise UsageError(f"ringsync: store keys are str, not {type(key).__name__}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"ringsync: the store key {key!r} is not valid Unicode") from None
    if len(raw) > MAX_KEY_BYTES:
        raise UsageError(f"ringsync: a store key of {len(raw)} bytes is over "
                         f"MAX_KEY_BYTES={MAX_KEY_BYTES}")
    return raw


def _value_bytes(value) -> bytes:
    if isinstance(value, str):  # (as torch's Store.set accepts)
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise UsageError(f"ringsync: store values are bytes, not {type(value).__name__}")


def _key_list(keys) -> List[str]:
    return [keys] if isinstance(keys, str) else list(keys)


def _pack_key(key: str) -> bytes:
    raw = _key_bytes(key)
    return struct.pack(">H", len(raw)) + raw


def _pack_value(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def _pack_keys(keys: List[str]) -> bytes:
    return struct.pack(">I", len(keys)) + b"".join(_pack_key(k) for k in keys)


def _pack_ms(seconds: float) -> bytes:
    return struct.pack(">Q", math.ceil(seconds * 1000))


class _Reader:
    """Fields out of one authenticated payload; anything short or left over is _Malformed.
    Every length is checked against what is there before it is taken."""

    def __init__(self, data):
        self._data = memoryview(data)
        self._at = 0

    def _take(self, n: int) -> bytes:
        if n > len(self._data) - self._at:
            raise _Malformed("a field runs past the end of its frame")
        chunk = bytes(self._data[self._at:self._at + n])
        self._at += n
        return chunk

    def _unpack(self, fmt: str) -> int:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def u8(self) -> int:
        return self._unpack(">B")

    def u64(self) -> int:
        return self._unpack(">Q")

    def i64(self) -> int:
        return self._unpack(">q")

    def key(self) -> str:
        length = self._unpack(">H")
        if length > MAX_KEY_BYTES:
            raise _Malformed(f"a key of {length} bytes")
        try:
            return self._take(length).decode("utf-8")
        except UnicodeDecodeError:
            raise _Malformed("a key that is not UTF-8") from None

    def value(self) -> bytes:
        return self._take(self._unpack(">I"))

    def keys(self) -> List[str]:
        count = self._unpack(">I")
        if count * 2 > len(self._data) - self._at:  # (every key takes 2 bytes at least)
            raise _Malformed(f"a list of {count} keys in a shorter frame")
        return [self.key() for _ in range(count)]

    def rest(self) -> bytes:
        return self._take(len(self._data) - self._at)

    def end(self) -> None:
        if self._at != len(self._data):
            raise _Malformed("bytes left over after the last field")


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
    """n bytes (n already checked against a limit); a deadline bounds the whole read."""
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            sock.settimeout(left)
        count = sock.recv_into(view[got:])
        if count == 0:
            raise _Closed("the connection was closed")
        got += count
    return buffer


def _tune(sock: socket.socket) -> None:
    """No Nagle delay for small requests; keepalive so that a vanished host is noticed in
    seconds (an idle connection otherwise looks alive forever)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPALIVE", 2), ("TCP_KEEPINTVL", 1),
                        ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _shut(sock: socket.socket) -> None:
    """Wake whatever thread waits on sock (close() alone does not, and could let its
    descriptor be reused under that thread)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _Channel:
    """Authenticated frames over one socket, after the handshake (see the module's
    docstring). Not thread-safe: its owner serializes requests."""

    def __init__(self, sock: socket.socket, session_key: bytes, outgoing: bytes,
                 incoming: bytes, limit: int):
        self.sock, self.limit = sock, limit
        self._key, self._outgoing, self._incoming = session_key, outgoing, incoming
        self._sent = self._received = 0

    def send(self, payload: bytes) -> None:
        seq = struct.pack(">Q", self._sent)
        tag = _mac(self._key, self._outgoing, seq, payload)
        self.sock.sendall(b"".join((struct.pack(">I", len(payload)), seq, payload, tag)))
        self._sent += 1

    def recv(self) -> memoryview:
        length, seq = FRAME_HEADER.unpack(_recv_exact(self.sock, FRAME_HEADER.size))
        if length > self.limit:  # (before reading or allocating any of it)
            raise _Malformed(f"a frame of {length} bytes, over the limit of {self.limit}")
        if seq != self._received:
            raise _Malformed(f"frame {seq} where {self._received} was due (a replay?)")
        body = memoryview(_recv_exact(self.sock, length + TAG_BYTES))
        payload = body[:length]
        expected = _mac(self._key, self._incoming, struct.pack(">Q", seq), payload)
        if not hmac.compare_digest(expected, body[length:]):
            raise _Malformed("a frame whose tag does not verify")
        self._received += 1
        return payload


# --- what add and compare_set mean (torch's semantics), for both stores ----------------

def _added(current: Optional[bytes], amount: int) -> Tuple[int, bytes]:
    """The counter after adding amount to current (missing: 0), and its stored form."""
    if current is not None and not _COUNTER.match(current):
        raise _Refused("it holds a value that is not an integer counter")
    total = (int(current) if current is not None else 0) + amount
    if not _INT64[0] <= total <= _INT64[1]:
        raise _Refused("the sum is out of the 64-bit range")
    return total, str(total).encode("ascii")


def _compare_and_set(current: Optional[bytes], expected: bytes,
                     desired: bytes) -> Tuple[Optional[bytes], bytes]:
    """(what to store, or None to leave the key be; what to answer), as torch's
    compareSet: a missing key counts as b"" for the comparison but, unmatched, the
    answer is `expected`."""
    if current is None:
        return (desired, desired) if expected == b"" else (None, expected)
    if current == expected:
        return desired, desired
    return None, current
