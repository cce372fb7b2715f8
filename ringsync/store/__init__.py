"""An authenticated key-value store where ringsync's ranks meet when there is no MPI.

Like torch's TCPStore (``set``, a waiting ``get``, ``add``, ``check``, ``delete_key``,
``compare_set``, ``wait``), so that ringsync.rendezvous_store can use either, but every
request is authenticated by the job's secret (RINGSYNC_SECRET or RINGSYNC_SECRET_FILE,
see load_secret): the rendezvous unpickles what ranks post, so a store that anyone on the
network could write to would run anyone's code. The store is served by the launcher, by
rank 0, or by ``python -m ringsync.store serve``; connect() reaches it by url.

Design
------
The server (StoreServer) is one accepting thread and one thread per connection, over one
table of keys guarded by a threading.Condition: a waiting get/wait sleeps on it with a
deadline, and looks at its socket between naps so that a client that went away stops
holding the thread (and, above all, releases its ephemeral keys at once).

The wire, for each connection:

1. Handshake, bounded by ``handshake_seconds``; the secret itself never travels::

     server -> client   server_nonce (32 random bytes)
     client -> server   client_nonce (32) + HMAC(secret, "ringsync-store client" + sn + cn)
     server -> client   HMAC(secret, "ringsync-store server" + cn + sn)

   Each side checks the other's proof (hmac.compare_digest), so neither an impostor client
   nor an impostor server gets past it; the labels differ, so neither proof can be
   reflected as the other. The session key is HMAC(secret, "ringsync-store session" + sn
   + cn): fresh for every connection.

2. Frames, both ways: ``length (4, big-endian) + seq (8) + payload + tag (32)`` where the
   tag is HMAC(session_key, direction + seq + payload) and seq counts 0, 1, 2... in each
   direction. A forged, altered, replayed or reordered frame fails the tag or the sequence
   check, and the connection is dropped before anything is done. The length is checked
   against the frame limit (the value limit plus a little) before anything is read or
   allocated, by the client too: until it has checked a frame's tag the server is as
   untrusted as any peer. The server's first frame ("hello") tells the client its value
   limit and who serves it, for error messages.

3. Payloads: an op byte, then fields: a key is u16 length + UTF-8, a value is u32 length
   + bytes, a key list is u32 count + keys, integers are fixed width. Nothing is
   unpickled; a payload that does not parse exactly (unknown op, bad UTF-8, fields cut
   short, bytes left over) drops the connection. Replies are a status byte and a body.

Values are authenticated, not encrypted: anyone on the path can read them.

Ephemeral keys (``hold``) belong to the connection that set them and are deleted when it
ends, whether the process closed it, died, or its host vanished (TCP keepalive on every
socket: 2 s idle, then 1 s probes, 3 of them). Elastic recovery reads them as liveness.

FileStore offers the same methods over a shared directory (``file:///dir``) for clusters
with a common file system: one file per key, written atomically, tagged with an HMAC of
the key and value so that a file the job did not write is not seen.
"""
import argparse
import os
import signal
import socket
import stat
import sys
import threading
from typing import Optional
from urllib.parse import unquote, urlsplit

from ..errors import UsageError
from ._wire import (MIN_SECRET_CHARS)
from ._client import StoreClient
from ._wire import MAX_KEY_BYTES, MAX_VALUE_BYTES
from ._files import FileStore
from ._server import StoreServer

__all__ = ["StoreServer", "StoreClient", "FileStore", "connect", "load_secret",
           "MAX_KEY_BYTES", "MAX_VALUE_BYTES"]

# --- urls and secrets -----------------------------------------------------------------

def connect(url: str, secret: bytes, timeout: float = 300.0, connect_timeout: float = 60.0):
    """A StoreClient for tcp://HOST:PORT, a FileStore for file:///ABSOLUTE/DIR."""
    bad = UsageError(f"ringsync: the store url {url!r} is neither tcp://HOST:PORT nor "
                     f"file:///ABSOLUTE/DIR")
    try:
        parts = urlsplit(url)
        port = parts.port
    except (ValueError, TypeError, AttributeError):
        raise bad from None
    if parts.scheme == "tcp":
        if not parts.hostname or port is None or parts.path not in ("", "/") or parts.query:
            raise bad
        return StoreClient(parts.hostname, port, secret, timeout, connect_timeout)
    if parts.scheme == "file":
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/") or parts.query:
            raise bad
        return FileStore(path, secret, timeout)
    raise bad


def load_secret(environ=os.environ) -> Optional[bytes]:
    """The job's secret: RINGSYNC_SECRET (its UTF-8 bytes, 16 characters at least), else
    the contents of the file RINGSYNC_SECRET_FILE names (its trailing newline stripped;
    the file must be private to its owner), else None. An empty variable counts as unset.
    No message ever shows the secret."""
    text = environ.get("RINGSYNC_SECRET")
    if text:
        if len(text) < MIN_SECRET_CHARS:
            raise UsageError(f"ringsync: RINGSYNC_SECRET is too short: use "
                             f"{MIN_SECRET_CHARS} characters at least (e.g. python -c "
                             f"'import secrets; print(secrets.token_hex(32))')")
        return text.encode("utf-8", "surrogateescape")
    path = environ.get("RINGSYNC_SECRET_FILE")
    if path:
        return _read_secret_file(path)
    return None


def _read_secret_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise UsageError(f"ringsync: cannot read RINGSYNC_SECRET_FILE {path!r}: "
                         f"{exc.strerror}") from None
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # (of the file opened: no race)
        if mode & 0o077:
            raise UsageError(f"ringsync: RINGSYNC_SECRET_FILE {path!r} is open to its group "
                             f"or others (mode {mode:04o}): make it private (chmod 600)")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(1 << 16)
    except OSError as exc:
        raise UsageError(f"ringsync: cannot read RINGSYNC_SECRET_FILE {path!r}: "
                         f"{exc.strerror}") from None
    finally:
        os.close(fd)
    secret = data.rstrip(b"\r\n")
    if len(secret) < MIN_SECRET_CHARS:
        raise UsageError(f"ringsync: the secret in RINGSYNC_SECRET_FILE {path!r} is too "
                         f"short: use {MIN_SECRET_CHARS} bytes at least")
    return secret


# --- python -m ringsync.store serve ---------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ringsync.store",
        description="Serve a ringsync store for one job (its secret from RINGSYNC_SECRET "
                    "or RINGSYNC_SECRET_FILE).")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a store and print its tcp:// url")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    serve.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    args = parser.parse_args(argv)
    try:
        secret = load_secret()
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    if secret is None:
        print("ringsync: set RINGSYNC_SECRET or RINGSYNC_SECRET_FILE: the store serves only "
              "clients that know the job's secret", file=sys.stderr)
        return 2
    return _serve_until_signalled(secret, args.host, args.port)


def _serve_until_signalled(secret: bytes, host: str, port: int) -> int:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    served_by = (f"`python -m ringsync.store serve` on {socket.gethostname()} "
                 f"(pid {os.getpid()})")
    try:
        server = StoreServer(secret, host, port, served_by=served_by)
    except OSError as exc:
        print(f"ringsync: cannot serve a store on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    with server:
        print(server.url, flush=True)
        while not stop.wait(1.0):
            pass
    return 0
