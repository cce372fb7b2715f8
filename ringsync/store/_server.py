"""StoreServer: the accepting thread, one thread per connection, the table of keys."""
import hmac
import secrets
import select
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Tuple

from ._wire import (CLIENT_PROOF, FRAME_OVERHEAD, HELLO_LIMIT, MAX_VALUE_BYTES, NONCE_BYTES,
                    OP_ADD, OP_CHECK, OP_COMPARE_SET, OP_DELETE, OP_GET, OP_HOLD, OP_SET,
                    OP_WAIT, SERVER_PROOF, SESSION_KEY, ST_HELLO, ST_OK, ST_REFUSED, ST_TIMEOUT,
                    TO_CLIENT, TO_SERVER, _Channel, _Closed, _MAX_SECONDS, _Malformed,
                    _PEER_CHECK_SECONDS, _Reader, _Refused, _added, _check_secret,
                    _compare_and_set, _mac, _pack_keys, _recv_exact, _shut, _tcp_url, _tune)


# --- the server -----------------------------------------------------------------------

class _Table:
    """The keys, their limits, and who holds which ephemeral key; one Condition guards it
    all and is notified on every change."""

    def __init__(self, max_value_bytes: int, max_total_bytes: int, max_keys: int):
        self.max_value_bytes = max_value_bytes
        self._max_total_bytes, self._max_keys = max_total_bytes, max_keys
        self._values: Dict[str, bytes] = {}
        self._owners: Dict[str, int] = {}  # ephemeral key -> the connection holding it
        self._bytes = 0  # keys' UTF-8 and values' bytes, together
        self._changed = threading.Condition()
        self.closing = False
        self.waiting = 0  # requests waiting for keys now (tests look at it)

    def _put(self, key: str, value: bytes, owner: Optional[int] = None) -> None:
        """Store (lock held), or raise _Refused leaving everything as it was. A write by
        anything but hold makes the key an ordinary one."""
        if len(value) > self.max_value_bytes:
            raise _Refused(f"a value of {len(value)} bytes is over the store's "
                           f"max_value_bytes={self.max_value_bytes}")
        old = self._values.get(key)
        if old is None and len(self._values) >= self._max_keys:
            raise _Refused(f"the store holds max_keys={self._max_keys} keys already")
        grown = self._bytes + len(value) - (
            len(old) if old is not None else -len(key.encode("utf-8")))
        if grown > self._max_total_bytes:
            raise _Refused(f"the store would hold more than "
                           f"max_total_bytes={self._max_total_bytes} bytes")
        self._values[key], self._bytes = value, grown
        if owner is None:
            self._owners.pop(key, None)
        else:
            self._owners[key] = owner
        self._changed.notify_all()

    def _drop(self, key: str) -> bool:
        value = self._values.pop(key, None)
        self._owners.pop(key, None)
        if value is None:
            return False
        self._bytes -= len(key.encode("utf-8")) + len(value)
        self._changed.notify_all()
        return True

    def set(self, key: str, value: bytes, owner: Optional[int] = None) -> None:
        with self._changed:
            self._put(key, value, owner)

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            total, stored = _added(self._values.get(key), amount)
            self._put(key, stored)
            return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            store, answer = _compare_and_set(self._values.get(key), expected, desired)
            if store is not None:
                self._put(key, store)
            return answer

    def check(self, keys: List[str]) -> bool:
        with self._changed:
            return all(k in self._values for k in keys)

    def delete(self, key: str) -> bool:
        with self._changed:
            return self._drop(key)

    def release(self, owner: int) -> None:
        """Delete the ephemeral keys a connection that ended held."""
        with self._changed:
            for key in [k for k, o in self._owners.items() if o == owner]:
                self._drop(key)

    def shut(self) -> None:
        with self._changed:
            self.closing = True
            self._changed.notify_all()

    def wait(self, keys: List[str], seconds: float, peer_gone) -> Tuple[List[str], List[bytes]]:
        """(missing keys, []) after `seconds` if some never came, else ([], their values).
        Raises _Closed when the server closes or peer_gone() says the client left."""
        deadline = time.monotonic() + seconds
        while True:
            with self._changed:
                missing = [k for k in keys if k not in self._values]
                left = deadline - time.monotonic()
                if missing and left > 0 and not self.closing:
                    self.waiting += 1
                    self._changed.wait(min(left, _PEER_CHECK_SECONDS))
                    self.waiting -= 1
                    missing = [k for k in keys if k not in self._values]
                if self.closing:
                    raise _Closed("the store is closing")
                if not missing:
                    return [], [self._values[k] for k in keys]
            if deadline - time.monotonic() <= 0:
                return missing, []
            if peer_gone():  # (outside the lock: it is a system call)
                raise _Closed("the client left while it waited")


class _Connection:
    """One client's connection, served on its own thread: handshake, then requests."""

    def __init__(self, server: "StoreServer", sock: socket.socket, number: int):
        self._server, self._sock, self.number = server, sock, number
        self._table = server._table
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"ringsync-store-conn-{number}")

    def abort(self) -> None:
        _shut(self._sock)

    def _run(self) -> None:
        try:
            channel = self._handshake()
            if channel is not None:
                self._serve(channel)
        except (OSError, _Malformed):
            pass  # a broken, rogue or departed client: its connection ends, nothing else
        finally:
            self._table.release(self.number)
            self._server._forget(self)
            _shut(self._sock)
            self._sock.close()

    def _handshake(self) -> Optional[_Channel]:
        secret = self._server._secret
        seconds = self._server._handshake_seconds
        deadline = time.monotonic() + seconds
        _tune(self._sock)
        self._sock.settimeout(seconds)
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        self._sock.sendall(server_nonce)
        answer = bytes(_recv_exact(self._sock, 2 * NONCE_BYTES, deadline))
        client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(secret, CLIENT_PROOF, server_nonce,
                                               client_nonce)):
            return None
        self._sock.sendall(_mac(secret, SERVER_PROOF, client_nonce, server_nonce))
        self._sock.settimeout(None)  # (an idle client may stay: keepalive watches it)
        channel = _Channel(self._sock, _mac(secret, SESSION_KEY, server_nonce, client_nonce),
                           TO_CLIENT, TO_SERVER, self._table.max_value_bytes + FRAME_OVERHEAD)
        served_by = self._server.served_by.encode("utf-8", "replace")[:HELLO_LIMIT // 2]
        channel.send(bytes([ST_HELLO]) + struct.pack(">Q", self._table.max_value_bytes)
                     + served_by)
        return channel

    def _serve(self, channel: _Channel) -> None:
        while True:
            payload = channel.recv()
            try:
                reply = self._answer(_Reader(payload))
            except _Refused as exc:
                reply = bytes([ST_REFUSED]) + str(exc).encode("utf-8")
            channel.send(reply)

    def _answer(self, request: _Reader) -> bytes:
        op = request.u8()
        handler = self._HANDLERS.get(op)
        if handler is None:
            raise _Malformed(f"unknown op {op}")
        return handler(self, request)

    # Each handler reads every field and checks that nothing is left before it acts.

    def _set(self, request: _Reader) -> bytes:
        key, value = request.key(), request.value()
        request.end()
        self._table.set(key, value)
        return bytes([ST_OK])

    def _hold(self, request: _Reader) -> bytes:
        key, value = request.key(), request.value()
        request.end()
        self._table.set(key, value, owner=self.number)
        return bytes([ST_OK])

    def _get(self, request: _Reader) -> bytes:
        key, milliseconds = request.key(), request.u64()
        request.end()
        missing, values = self._table.wait([key], min(milliseconds / 1000, _MAX_SECONDS),
                                           self._peer_gone)
        if missing:
            return bytes([ST_TIMEOUT]) + _pack_keys(missing)
        return bytes([ST_OK]) + values[0]

    def _wait(self, request: _Reader) -> bytes:
        keys, milliseconds = request.keys(), request.u64()
        request.end()
        missing, _ = self._table.wait(keys, min(milliseconds / 1000, _MAX_SECONDS),
                                      self._peer_gone)
        if missing:
            return bytes([ST_TIMEOUT]) + _pack_keys(missing)
        return bytes([ST_OK])

    def _add(self, request: _Reader) -> bytes:
        key, amount = request.key(), request.i64()
        request.end()
        return bytes([ST_OK]) + struct.pack(">q", self._table.add(key, amount))

    def _check(self, request: _Reader) -> bytes:
        keys = request.keys()
        request.end()
        return bytes([ST_OK, self._table.check(keys)])

    def _delete(self, request: _Reader) -> bytes:
        key = request.key()
        request.end()
        return bytes([ST_OK, self._table.delete(key)])

    def _compare_set(self, request: _Reader) -> bytes:
        key, expected, desired = request.key(), request.value(), request.value()
        request.end()
        return bytes([ST_OK]) + self._table.compare_set(key, expected, desired)

    _HANDLERS = {OP_SET: _set, OP_GET: _get, OP_ADD: _add, OP_CHECK: _check,
                 OP_DELETE: _delete, OP_COMPARE_SET: _compare_set, OP_WAIT: _wait,
                 OP_HOLD: _hold}

    def _peer_gone(self) -> bool:
        """Whether the client hung up (or broke the protocol by sending before this
        request's answer) while its request waits: then the wait ends at once."""
        try:
            poller = select.poll()
            poller.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True


class StoreServer:
    """Serves one job's store on host:port (port 0: any free one). It listens as soon as
    it is made (so that its address can be handed out); start() serves, close() stops and
    drops every client. Only clients that prove they know `secret` are served.

    served_by: who serves it, in words ("the launcher on host X"), sent to clients once
    they are authenticated, for their error messages."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *,
                 max_value_bytes: int = MAX_VALUE_BYTES, max_total_bytes: int = 256 << 20,
                 max_keys: int = 1 << 16, max_connections: int = 1024,
                 handshake_seconds: float = 5.0, served_by: str = "a ringsync store"):
        self._secret = _check_secret(secret)
        self.served_by = served_by
        self._table = _Table(int(max_value_bytes), int(max_total_bytes), int(max_keys))
        self._max_connections = int(max_connections)
        self._handshake_seconds = float(handshake_seconds)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family,
                                              backlog=min(max(self._max_connections, 16), 1024))
        self._listener.settimeout(0.5)  # (the accept loop looks at _stopped this often)
        self._host, self._port = host, self._listener.getsockname()[1]
        self._lock = threading.Lock()  # guards _connections, _count, _closed
        self._connections: Dict[int, _Connection] = {}
        self._count = 0
        self._closed = False
        self._stopped = threading.Event()
        self._acceptor: Optional[threading.Thread] = None

    @property
    def address(self) -> Tuple[str, int]:
        return self._host, self._port

    @property
    def url(self) -> str:
        """tcp://HOST:PORT, with this host's name where the store listens on every address."""
        host = socket.gethostname() if self._host in ("", "0.0.0.0", "::") else self._host
        return _tcp_url(host, self._port)

    def __repr__(self) -> str:
        return f"StoreServer({self.url}, served by {self.served_by})"

    def start(self) -> "StoreServer":
        with self._lock:
            if self._acceptor is None and not self._closed:
                self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                                  name="ringsync-store-accept")
                self._acceptor.start()
        return self

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections.values())
            acceptor = self._acceptor
        self._stopped.set()
        self._table.shut()
        _shut(self._listener)
        self._listener.close()
        for connection in connections:
            connection.abort()
        for thread in [acceptor] + [c.thread for c in connections]:
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5.0)

    def __enter__(self) -> "StoreServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                # closed under us, or out of descriptors: pause rather than spin
                self._stopped.wait(0.05)
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        with self._lock:
            if self._closed or len(self._connections) >= self._max_connections:
                connection = None
            else:
                self._count += 1
                connection = _Connection(self, sock, self._count)
                self._connections[connection.number] = connection
        if connection is None:
            sock.close()  # (at the limit: closed at once, before any handshake)
        else:
            connection.thread.start()

    def _forget(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.pop(connection.number, None)

    def close_when_clients_leave(self, seconds: float) -> None:
        """close(), once every client has disconnected or `seconds` passed: a rank that
        serves its job's store must not take it away in the middle of another rank's last
        exchange."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self._lock:
                if not self._connections:
                    break
            self._stopped.wait(0.01)
        self.close()
