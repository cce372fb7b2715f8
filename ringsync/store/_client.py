"""StoreClient: one authenticated connection to a StoreServer."""
import hmac
import secrets
import socket
import struct
import threading
import time
from typing import Iterable, Optional, Tuple

from ..errors import CommunicationError, CommunicationTimeout, StoreLostError, UsageError
from ._wire import (CLIENT_PROOF, FRAME_OVERHEAD, HELLO_LIMIT, NONCE_BYTES, OP_ADD, OP_CHECK,
                    OP_COMPARE_SET, OP_DELETE, OP_GET, OP_HOLD, OP_SET, OP_WAIT, SERVER_PROOF,
                    SESSION_KEY, ST_HELLO, ST_OK, ST_REFUSED, ST_TIMEOUT, TAG_BYTES, TO_CLIENT,
                    TO_SERVER, _ANSWER_GRACE_SECONDS, _Channel, _Closed, _INT64, _Malformed,
                    _Reader, _check_secret, _key_list, _mac, _pack_key, _pack_keys, _pack_ms,
                    _pack_value, _recv_exact, _seconds, _shut, _tcp_url, _tune, _value_bytes)


# --- the client -----------------------------------------------------------------------

class StoreClient:
    """A connection to a StoreServer, authenticated by the job's secret. Usable from
    several threads, but one request at a time goes over the wire (as with torch's
    TCPStore): a get() that waits holds up this client's other requests, so a thread
    that must set while another waits needs a client of its own.

    timeout: seconds get() and wait() wait for keys (set_timeout changes it);
    connect_timeout: seconds to keep trying to reach a server that may start later."""

    notices_lost_clients = True  # hold(): the server drops a dead client's keys

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 300.0,
                 connect_timeout: float = 60.0):
        self._secret = _check_secret(secret)
        self._host, self._port = host, int(port)
        self.timeout = _seconds(timeout)
        self.served_by = ""
        self._lock = threading.Lock()  # one request and its answer at a time
        self._closed = False
        self._lost: Optional[str] = None  # why the connection broke, once it has
        deadline = time.monotonic() + _seconds(connect_timeout)
        sock = self._connect(deadline, connect_timeout)
        try:
            self._channel = self._handshake(sock, max(deadline, time.monotonic() + 10.0))
        except BaseException:
            sock.close()
            raise

    @property
    def url(self) -> str:
        return _tcp_url(self._host, self._port)

    def __repr__(self) -> str:
        return f"StoreClient({self.url})"

    def _where(self) -> str:
        return f"{self.url} ({self.served_by})" if self.served_by else self.url

    def _connect(self, deadline: float, connect_timeout) -> socket.socket:
        """Retry until the deadline: the server may not be listening yet."""
        pause = 0.02
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self._host, self._port),
                                                timeout=min(max(left, 0.1), 10.0))
                _tune(sock)
                return sock
            except OSError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommunicationTimeout(
                        f"ringsync: could not reach the store at {self.url} within "
                        f"{connect_timeout} s ({exc})") from None
                time.sleep(min(pause, left))  # (back off between attempts)
                pause = min(pause * 2, 1.0)

    def _handshake(self, sock: socket.socket, deadline: float) -> _Channel:
        try:
            server_nonce = bytes(_recv_exact(sock, NONCE_BYTES, deadline))
        except _Closed:
            raise CommunicationError(
                f"ringsync: the store at {self.url} closed the connection at once (it may "
                f"be at its connection limit)") from None
        except OSError as exc:
            raise self._handshake_failed(exc) from None
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            sock.sendall(client_nonce + _mac(self._secret, CLIENT_PROOF, server_nonce,
                                             client_nonce))
            proof = bytes(_recv_exact(sock, TAG_BYTES, deadline))
        except _Closed:
            raise CommunicationError(
                f"ringsync: the store at {self.url} refused this process: it was started "
                f"with another secret than this job's") from None
        except OSError as exc:
            raise self._handshake_failed(exc) from None
        if not hmac.compare_digest(proof, _mac(self._secret, SERVER_PROOF, client_nonce,
                                               server_nonce)):
            raise CommunicationError(f"ringsync: the store at {self.url} does not know this "
                                     f"job's secret")
        channel = _Channel(sock, _mac(self._secret, SESSION_KEY, server_nonce, client_nonce),
                           TO_SERVER, TO_CLIENT, HELLO_LIMIT)
        try:
            hello = _Reader(channel.recv())
            if hello.u8() != ST_HELLO:
                raise _Malformed("no hello")
            self._max_value_bytes = hello.u64()
            self.served_by = hello.rest().decode("utf-8", "replace")
        except (OSError, _Malformed) as exc:
            raise self._handshake_failed(exc) from None
        channel.limit = self._max_value_bytes + FRAME_OVERHEAD
        return channel

    def _handshake_failed(self, exc: Exception) -> CommunicationError:
        if isinstance(exc, socket.timeout):
            return CommunicationTimeout(f"ringsync: the store at {self.url} did not finish "
                                        f"the handshake in time (is it a ringsync store?)")
        return CommunicationError(f"ringsync: the handshake with the store at {self.url} "
                                  f"failed: {exc}")

    def _request(self, payload: bytes, answer_within: float) -> Tuple[int, _Reader]:
        """Send one request, read its answer: (status, the rest of the answer)."""
        with self._lock:
            if self._closed:
                raise UsageError(f"ringsync: this client of the store at {self.url} is closed")
            if self._lost is not None:
                raise StoreLostError(f"ringsync: lost the store at {self._where()}: "
                                         f"{self._lost}")
            try:
                self._channel.sock.settimeout(answer_within)
                self._channel.send(payload)
                answer = _Reader(self._channel.recv())
                return answer.u8(), answer
            except socket.timeout:
                self._lose(f"it did not answer within {answer_within:g} s")
                raise CommunicationTimeout(f"ringsync: the store at {self._where()} did not "
                                           f"answer within {answer_within:g} s") from None
            except (OSError, _Malformed) as exc:
                self._lose("this client was closed" if self._closed else str(exc))
                raise StoreLostError(f"ringsync: lost the store at {self._where()}: "
                                         f"{self._lost}") from None

    def _lose(self, reason: str) -> None:
        """The connection is out of step or gone: no later request may use it."""
        self._lost = reason
        _shut(self._channel.sock)
        self._channel.sock.close()

    def _refused(self, status: int, answer: _Reader, what: str) -> None:
        """Raise unless the answer is ST_OK."""
        if status == ST_REFUSED:
            reason = answer.rest().decode("utf-8", "replace")
            raise UsageError(f"ringsync: the store at {self.url} refused to {what}: {reason}")
        if status != ST_OK:
            raise CommunicationError(f"ringsync: the store at {self.url} answered {what} "
                                     f"with status {status} (another ringsync version?)")

    def _fit(self, value, what: str) -> bytes:
        value = _value_bytes(value)
        if len(value) > self._max_value_bytes:
            raise UsageError(f"ringsync: cannot {what}: a value of {len(value)} bytes is over "
                             f"the store's max_value_bytes={self._max_value_bytes}")
        return value

    def _timed_out(self, answer: _Reader, seconds: float) -> CommunicationTimeout:
        try:
            missing = answer.keys()
        except _Malformed:
            missing = []
        return CommunicationTimeout(f"ringsync: waited {seconds:g} s in vain for the key(s) "
                                    f"{missing} in the store at {self._where()}")

    def set(self, key: str, value: bytes) -> None:
        value = self._fit(value, f"set {key!r}")
        status, answer = self._request(bytes([OP_SET]) + _pack_key(key) + _pack_value(value),
                                       self.timeout + _ANSWER_GRACE_SECONDS)
        self._refused(status, answer, f"set {key!r}")

    def hold(self, key: str, value: bytes = b"1") -> None:
        """Set an ephemeral key: the server deletes it when this client's connection ends
        (close(), the process killed, its host gone). A later set() of the key, from any
        client, makes it an ordinary key."""
        value = self._fit(value, f"hold {key!r}")
        status, answer = self._request(bytes([OP_HOLD]) + _pack_key(key) + _pack_value(value),
                                       self.timeout + _ANSWER_GRACE_SECONDS)
        self._refused(status, answer, f"hold {key!r}")

    def get(self, key: str) -> bytes:
        """The key's value, waiting up to self.timeout for it to be set."""
        seconds = self.timeout
        status, answer = self._request(bytes([OP_GET]) + _pack_key(key) + _pack_ms(seconds),
                                       seconds + _ANSWER_GRACE_SECONDS)
        if status == ST_TIMEOUT:
            raise CommunicationTimeout(f"ringsync: waited {seconds:g} s in vain for the key "
                                       f"{key!r} in the store at {self._where()}")
        self._refused(status, answer, f"get {key!r}")
        return answer.rest()

    def wait(self, keys: Iterable[str], timeout: Optional[float] = None) -> None:
        """Until every key exists (up to timeout, or self.timeout)."""
        keys = _key_list(keys)
        seconds = self.timeout if timeout is None else _seconds(timeout)
        status, answer = self._request(bytes([OP_WAIT]) + _pack_keys(keys) + _pack_ms(seconds),
                                       seconds + _ANSWER_GRACE_SECONDS)
        if status == ST_TIMEOUT:
            raise self._timed_out(answer, seconds)
        self._refused(status, answer, "wait")

    def add(self, key: str, amount: int) -> int:
        """Add to the integer counter at key (stored as ASCII decimal; missing: 0)."""
        if isinstance(amount, bool) or not isinstance(amount, int) or \
                not _INT64[0] <= amount <= _INT64[1]:
            raise UsageError(f"ringsync: store add() takes a 64-bit int, not {amount!r}")
        status, answer = self._request(bytes([OP_ADD]) + _pack_key(key)
                                       + struct.pack(">q", amount),
                                       self.timeout + _ANSWER_GRACE_SECONDS)
        self._refused(status, answer, f"add to {key!r}")
        return answer.i64()

    def check(self, keys) -> bool:
        """Whether every key exists now (no waiting)."""
        status, answer = self._request(bytes([OP_CHECK]) + _pack_keys(_key_list(keys)),
                                       self.timeout + _ANSWER_GRACE_SECONDS)
        self._refused(status, answer, "check keys")
        return bool(answer.u8())

    def delete_key(self, key: str) -> bool:
        """Delete the key; whether it existed."""
        status, answer = self._request(bytes([OP_DELETE]) + _pack_key(key),
                                       self.timeout + _ANSWER_GRACE_SECONDS)
        self._refused(status, answer, f"delete {key!r}")
        return bool(answer.u8())

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's compare_set: store desired if the key holds expected (or is missing and
        expected is b""); answer the value now stored (missing and unmatched: expected).
        expected and desired together may not exceed the store's value limit (they
        share one frame)."""
        expected, desired = _value_bytes(expected), _value_bytes(desired)
        self._fit(expected + desired, f"compare_set {key!r}")
        status, answer = self._request(bytes([OP_COMPARE_SET]) + _pack_key(key)
                                       + _pack_value(expected) + _pack_value(desired),
                                       self.timeout + _ANSWER_GRACE_SECONDS)
        self._refused(status, answer, f"compare_set {key!r}")
        return answer.rest()

    def set_timeout(self, timeout) -> None:
        self.timeout = _seconds(timeout)

    def close(self) -> None:
        """Close the connection (the server drops this client's held keys). A request in
        flight on another thread fails at once."""
        self._closed = True
        _shut(self._channel.sock)  # (wakes such a request, which then frees the lock)
        with self._lock:
            self._channel.sock.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
