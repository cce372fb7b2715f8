"""The key-value store rendezvous: ranks meet through a store that every rank reaches, such
as the one torch.distributed builds for `init_process_group` (TCPStore under torchrun or
``env://``/``tcp://``, FileStore under ``file://``), so that a ring can start with no MPI.

The store is duck-typed: ``set(key, bytes)``, ``get(key) -> bytes`` (waiting for the key
up to the store's own timeout), ``add(key, n) -> int``, ``check(keys) -> bool``,
``delete_key(key)`` and, optionally, ``set_timeout(timedelta)``: torch's Store has them.
This module imports no framework.

Each exchange is a round: every rank sets its own key, then reads every rank's. What a
peer posted is unpickled, as MPI's object exchanges do: the store must be reachable only
by the job (torch's own object collectives trust it the same way).
"""
import datetime
import pickle
from typing import Any, List, Optional, Sequence

from .errors import CommunicationTimeout, UsageError
from .rendezvous import Rendezvous

DEFAULT_PREFIX = "ringsync"


class StoreRendezvous(Rendezvous):
    """`size` ranks meeting through `store` under the keys below `prefix`.

    timeout: seconds one exchange may wait for the other ranks (None: the store's own
    timeout). A rank that does not come in time fails the exchange on every rank that
    waits, with an error naming the ranks that did not post."""

    def __init__(self, store, rank: int, size: int, prefix: str = DEFAULT_PREFIX,
                 timeout: Optional[float] = None):
        if not 0 <= rank < size:
            raise UsageError(f"ringsync: store rendezvous rank {rank} is out of range for "
                             f"size {size}")
        self.rank, self.size = rank, size
        self._store, self._prefix = store, prefix
        self._round = 0  # exchanges done here: the same count on every rank
        self._splits = 0
        self.limit_exchanges(timeout)

    def limit_exchanges(self, seconds: Optional[float]) -> None:
        self.timeout = seconds
        if seconds is not None and hasattr(self._store, "set_timeout"):
            self._store.set_timeout(datetime.timedelta(seconds=seconds))

    def allgather(self, obj: Any) -> List[Any]:
        base = f"{self._prefix}/x{self._round}"
        self._round += 1
        self._store.set(f"{base}/{self.rank}", pickle.dumps(obj))
        posts = [self._read(base, r) for r in range(self.size)]
        self._forget(base)
        return posts

    def split(self, ranks: Sequence[int]) -> Optional["StoreRendezvous"]:
        ranks = sorted(set(int(r) for r in ranks))
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.size:
            raise UsageError(f"ringsync: cannot split ranks {list(ranks)} from a store "
                             f"rendezvous of {self.size} ranks")
        self._splits += 1  # (collective: the same number on every rank)
        if self.rank not in ranks:
            return None
        prefix = f"{self._prefix}/s{self._splits}-{'.'.join(map(str, ranks))}"
        return StoreRendezvous(self._store, ranks.index(self.rank), len(ranks), prefix,
                               self.timeout)

    def _read(self, base: str, rank: int) -> Any:
        key = f"{base}/{rank}"
        try:
            data = self._store.get(key)
        except Exception as exc:  # (torch raises DistStoreError on its timeout)
            raise CommunicationTimeout(
                f"ringsync: rank {self.rank}: the store rendezvous waited in vain for "
                f"rank(s) {self._missing(base)} of {self.size} ({type(exc).__name__}: "
                f"{exc})") from None
        try:
            return pickle.loads(data)
        except Exception as exc:
            raise UsageError(f"ringsync: rank {self.rank}: rank {rank}'s post under "
                             f"{key!r} in the store is not a ringsync exchange ({exc})") from None

    def _missing(self, base: str) -> List[int]:
        try:
            return [r for r in range(self.size) if not self._store.check([f"{base}/{r}"])]
        except Exception:
            return list(range(self.size))  # (the store itself is gone)

    def _forget(self, base: str) -> None:
        """The last rank to have read a round deletes its keys (a long job makes many
        rounds: process sets, tunes, recovery)."""
        if self._store.add(f"{base}/read", 1) == self.size:
            for r in range(self.size):
                self._store.delete_key(f"{base}/{r}")
            self._store.delete_key(f"{base}/read")
