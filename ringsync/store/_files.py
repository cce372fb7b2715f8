"""FileStore: the same methods over a directory every rank shares (file:///DIR)."""
import contextlib
import fcntl
import hashlib
import hmac
import os
import secrets
import time
from typing import Iterable, List, Optional

from ..errors import CommunicationTimeout, UsageError
from ._wire import (MAX_VALUE_BYTES, TAG_BYTES, _Refused, _added, _check_secret,
                    _compare_and_set, _key_bytes, _key_list, _mac, _seconds, _value_bytes)


# --- the file store -------------------------------------------------------------------

class _Unauthentic(Exception):
    """A key's file whose tag does not verify: not written by this job."""


class FileStore:
    """The store's methods over a shared directory (file:///dir) that every rank sees.

    One file per key, named by the key's hex (a hash for long keys: never a path made
    from the key), holding HMAC-SHA256(secret, key + value) + value; a file whose tag
    does not verify is absent to get/check/wait. Writes go to a temporary name and
    os.replace into place; set, add, compare_set and delete_key hold an flock on the
    directory's .lock file, so that they are atomic across processes and threads."""

    def __init__(self, path: str, secret: bytes, timeout: float = 300.0):
        self.path = os.path.abspath(path)
        self._secret = _check_secret(secret)
        self.timeout = _seconds(timeout)
        os.makedirs(self.path, mode=0o700, exist_ok=True)

    @property
    def url(self) -> str:
        return "file://" + self.path

    def __repr__(self) -> str:
        return f"FileStore({self.url})"

    def _file(self, key: str) -> str:
        raw = _key_bytes(key)
        name = "k" + raw.hex() if len(raw) <= 100 else "h" + hashlib.sha256(raw).hexdigest()
        return os.path.join(self.path, name)  # (hex digits only: no separator, no "..")

    def _tag(self, key: str, value: bytes) -> bytes:
        return _mac(self._secret, key.encode("utf-8"), value)

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # (per open file: threads exclude each other too)
            yield
        finally:
            os.close(fd)  # (releases the lock)

    def _read(self, key: str) -> Optional[bytes]:
        """The value, None if missing; _Unauthentic if its file was not written by us."""
        try:
            with open(self._file(key), "rb") as f:
                data = f.read(TAG_BYTES + MAX_VALUE_BYTES + 1)
        except FileNotFoundError:
            return None
        tag, value = data[:TAG_BYTES], data[TAG_BYTES:]
        if len(data) < TAG_BYTES or len(value) > MAX_VALUE_BYTES or \
                not hmac.compare_digest(tag, self._tag(key, value)):
            raise _Unauthentic(key)
        return value

    def _read_authentic(self, key: str) -> Optional[bytes]:
        try:
            return self._read(key)
        except _Unauthentic:
            return None

    def _read_to_change(self, key: str) -> Optional[bytes]:
        try:
            return self._read(key)
        except _Unauthentic:
            raise UsageError(f"ringsync: the file of key {key!r} in the store at {self.url} "
                             f"was not written by this job (its tag does not verify)") from None

    def _write(self, key: str, value: bytes) -> None:
        final, tag = self._file(key), self._tag(key, value)
        temporary = os.path.join(self.path, f".tmp-{secrets.token_hex(8)}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(tag + value)
            os.replace(temporary, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _fit(self, value, what: str) -> bytes:
        value = _value_bytes(value)
        if len(value) > MAX_VALUE_BYTES:
            raise UsageError(f"ringsync: cannot {what}: a value of {len(value)} bytes is over "
                             f"MAX_VALUE_BYTES={MAX_VALUE_BYTES}")
        return value

    def _poll(self, keys: List[str], seconds: float) -> List[str]:
        """The keys still missing after waiting up to `seconds` for all of them."""
        deadline = time.monotonic() + seconds
        pause = 0.001
        while True:
            missing = [k for k in keys if self._read_authentic(k) is None]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                return missing
            time.sleep(min(pause, left))  # (no change notification on a shared file system)
            pause = min(pause * 2, 0.05)

    def set(self, key: str, value: bytes) -> None:
        self._file(key)  # (checks the key before anything is written)
        value = self._fit(value, f"set {key!r}")
        with self._locked():
            self._write(key, value)

    def get(self, key: str) -> bytes:
        seconds = self.timeout
        deadline = time.monotonic() + seconds
        while True:
            if self._poll([key], max(deadline - time.monotonic(), 0.0)):
                raise CommunicationTimeout(f"ringsync: waited {seconds:g} s in vain for the "
                                           f"key {key!r} in the store at {self.url}")
            value = self._read_authentic(key)
            if value is not None:  # (else deleted again since the poll saw it)
                return value

    def wait(self, keys: Iterable[str], timeout: Optional[float] = None) -> None:
        seconds = self.timeout if timeout is None else _seconds(timeout)
        missing = self._poll(_key_list(keys), seconds)
        if missing:
            raise CommunicationTimeout(f"ringsync: waited {seconds:g} s in vain for the "
                                       f"key(s) {missing} in the store at {self.url}")

    def add(self, key: str, amount: int) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise UsageError(f"ringsync: store add() takes an int, not {amount!r}")
        with self._locked():
            try:
                total, stored = _added(self._read_to_change(key), amount)
            except _Refused as exc:
                raise UsageError(f"ringsync: cannot add to {key!r} in the store at "
                                 f"{self.url}: {exc}") from None
            self._write(key, stored)
        return total

    def check(self, keys) -> bool:
        return all(self._read_authentic(k) is not None for k in _key_list(keys))

    def delete_key(self, key: str) -> bool:
        """Delete the key's file; whether the key existed (a forged file: no)."""
        with self._locked():
            existed = self._read_authentic(key) is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(key))
        return existed

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        expected = _value_bytes(expected)
        desired = self._fit(desired, f"compare_set {key!r}")
        with self._locked():
            store, answer = _compare_and_set(self._read_to_change(key), expected, desired)
            if store is not None:
                self._write(key, store)
        return answer

    def hold(self, key: str, value: bytes = b"1") -> None:
        raise NotImplementedError("ringsync: a file store cannot tell when a process dies; "
                                  "elastic recovery needs tcp://")

    def set_timeout(self, timeout) -> None:
        self.timeout = _seconds(timeout)

    def close(self) -> None:
        pass  # (nothing is held open between calls)

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
