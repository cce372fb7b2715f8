"""The key-value store rendezvous: ranks meet through a store that every rank reaches, so
that a ring can start with no MPI. The store is ringsync's own (ringsync.store: every
request authenticated by the job secret), or torch's (TCPStore under torchrun, whatever
torch.distributed's ``init_process_group`` was given).

The store is duck-typed: ``set(key, bytes)``, ``get(key) -> bytes`` (waiting for the key
up to the store's own timeout), ``add(key, n) -> int``, ``check(keys) -> bool``,
``delete_key(key)`` and, optionally, ``set_timeout(timedelta)``: torch's Store has them.
Elastic recovery also needs ``compare_set`` and ``hold`` (a key the store drops when the
holder's connection ends: how the survivors learn who died), which only ringsync's TCP
store offers (``notices_lost_clients``). This module imports no framework.

Each exchange is a round: every rank sets its own key, then reads every rank's. What a
peer posted is unpickled, as MPI's object exchanges do: the store must be reachable only
by the job (ringsync's store refuses anyone without the secret; torch's own object
collectives trust torch's store the same way). What survivors and replacements agree on
after a failure travels as JSON and is checked before use.

Keys, below the job's root (``prefix``): ``g<G>/x<N>/<rank>`` the exchanges of generation
G (a generation is one membership of the job: each recovery or admission makes the next),
``alive/g<G>/r<rank>`` held by each rank while it lives (elastic only), ``g<G>/shrink/...``
the survivors' agreement, ``join/...`` replacements waiting to be admitted.
"""
import datetime
import hashlib
import hmac
import json
import pickle
import secrets
import time
from typing import Any, List, Optional, Sequence

from .bootstrap import JobKeys
from .errors import CommunicationError, CommunicationTimeout, RingsyncError, UsageError
from .rendezvous import FaultTolerance, Rendezvous

DEFAULT_PREFIX = "ringsync"


class JobFinished(SystemExit):
    """Raised in a replacement rank's init() when the job it was to join has finished:
    the process ends with status 0 (nothing failed), saying why."""

    def __init__(self, text: str):
        super().__init__(0)
        self.text = text

    def __str__(self) -> str:
        return self.text


class _Link:
    """The store and (on the rank that serves it) its server, shared by the rendezvous of
    every generation and process set of a job, and closed when the last one is: the
    server's rank waits, bounded, until the other ranks have left first, so that none
    loses the store in the middle of its last exchange."""

    LEAVE_WAIT_S = 30.0

    def __init__(self, store, server=None, owned: bool = False):
        self.store, self.server, self.owned, self.users = store, server, owned, 0

    def retain(self) -> "_Link":
        self.users += 1
        return self

    def release(self) -> None:
        self.users -= 1
        if self.users > 0 or not self.owned:
            return
        self.owned = False
        self.store.close()
        if self.server is not None:
            self.server.close_when_clients_leave(self.LEAVE_WAIT_S)


class StoreRendezvous(Rendezvous, FaultTolerance):
    """`size` ranks meeting through `store` under the keys below `prefix`.

    timeout: seconds one exchange may wait for the other ranks (None: the store's own
    timeout). A rank that does not come in time fails the exchange on every rank that
    waits, with an error naming the ranks that did not post. secret: the job's secret
    (the ring's keys are derived from it rather than sent through the store); server: the
    store this process serves, kept alive as long as the rendezvous; elastic: survivors
    of a lost rank recover through the store (needs a store with hold and compare_set)."""

    def __init__(self, store, rank: int, size: int, prefix: str = DEFAULT_PREFIX,
                 timeout: Optional[float] = None, *, secret: Optional[bytes] = None,
                 server=None, owns_store: bool = False, elastic: bool = False,
                 generation: int = 0, link: Optional[_Link] = None):
        """owns_store: close the store (and the server) once this rendezvous and every
        one made from it are closed (link: theirs, passed on)."""
        if not 0 <= rank < size:
            raise UsageError(f"ringsync: store rendezvous rank {rank} is out of range for "
                             f"size {size}")
        self.rank, self.size = rank, size
        self._link = (link or _Link(store, server, owns_store)).retain()
        self._store, self._root, self._secret = store, prefix, secret
        self._closed = False
        self.generation = generation
        self._prefix = prefix if generation == 0 else f"{prefix}/g{generation}"
        self._round = 0  # exchanges done here: the same count on every rank
        self._splits = 0
        self._elastic = elastic
        self.limit_exchanges(timeout)
        if self.recoverable:
            store.hold(self._alive_key(generation, rank))

    def _next(self, rank: int, size: int, generation: int) -> "StoreRendezvous":
        return StoreRendezvous(self._store, rank, size, self._root, self.timeout,
                               secret=self._secret, elastic=self._elastic,
                               generation=generation, link=self._link)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._link.release()

    @property
    def recoverable(self) -> bool:
        return self._elastic and getattr(self._store, "notices_lost_clients", False)

    def limit_exchanges(self, seconds: Optional[float]) -> None:
        self.timeout = seconds
        if seconds is not None and hasattr(self._store, "set_timeout"):
            self._store.set_timeout(datetime.timedelta(seconds=seconds))

    # ---- exchanges ----

    def allgather(self, obj: Any) -> List[Any]:
        base = f"{self._prefix}/x{self._round}"
        self._round += 1
        self._store.set(f"{base}/{self.rank}", pickle.dumps(obj))
        posts = [self._read(base, r) for r in range(self.size)]
        self._forget(base)
        return posts

    def job_keys(self) -> JobKeys:
        """With the job's secret, the ring's secret is derived from it and a fresh job id,
        so that it never crosses the store (whose traffic is authenticated, not hidden)."""
        if self._secret is None:
            return super().job_keys()
        job_id = self.bcast(secrets.randbits(63) if self.rank == 0 else None)
        ring = hmac.new(self._secret, b"ringsync ring" + job_id.to_bytes(8, "big"),
                        hashlib.sha256).digest()
        return JobKeys(job_id, ring)

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
                               self.timeout, secret=self._secret, link=self._link)

    def _read(self, base: str, rank: int) -> Any:
        key = f"{base}/{rank}"
        try:
            data = self._store.get(key)
        except CommunicationError as exc:
            if not isinstance(exc, CommunicationTimeout):
                raise  # the store itself is gone: its own words say so
            raise self._waited_in_vain(base, exc) from None
        except Exception as exc:  # (torch raises DistStoreError on its timeout)
            raise self._waited_in_vain(base, exc) from None
        try:
            return pickle.loads(data)
        except Exception as exc:
            raise UsageError(f"ringsync: rank {self.rank}: rank {rank}'s post under "
                             f"{key!r} in the store is not a ringsync exchange ({exc})") from None

    def _waited_in_vain(self, base: str, exc: Exception) -> CommunicationTimeout:
        return CommunicationTimeout(
            f"ringsync: rank {self.rank}: the store rendezvous waited in vain for rank(s) "
            f"{self._missing(base)} of {self.size} ({type(exc).__name__}: {exc})")

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

    # ---- elastic recovery (rendezvous.FaultTolerance) ----

    def _alive_key(self, generation: int, rank: int) -> str:
        return f"{self._root}/alive/g{generation}/r{rank}"

    def shrink(self):
        """Agree on the survivors: each posts that it arrived; once every rank of this
        generation has arrived or lost its liveness key (its process, or its host, is
        gone), or the timeout passed, the first decision written wins."""
        self._require_recoverable()
        base = f"{self._prefix}/shrink"
        self._store.set(f"{base}/in/{self.rank}", b"1")
        arrived = self._wait_for_survivors(base)
        decision = self._store.compare_set(f"{base}/decision", b"",
                                           json.dumps(arrived).encode())
        survivors = _rank_list(decision, self.size, "the survivors' decision")
        if self.rank not in survivors:
            # (not a CommunicationError: no recovery can take this rank back in; it ends)
            raise RingsyncError(
                f"ringsync: rank {self.rank} came to the recovery after the others had "
                f"agreed on the survivors {survivors} without it")
        lost = sorted(set(range(self.size)) - set(survivors))
        successor = self._next(survivors.index(self.rank), len(survivors),
                               self.generation + 1)
        self._hand_over()
        # Only now, with the liveness key gone: a rank still waiting above must see this
        # one as arrived or as gone, never as alive and away (it would wait the timeout).
        # The decision answers whoever comes later.
        self._store.delete_key(f"{base}/in/{self.rank}")
        return successor, lost

    def _wait_for_survivors(self, base: str) -> List[int]:
        deadline = time.monotonic() + (self.timeout or 120.0)
        pause = 0.002
        while True:
            arrived = [r for r in range(self.size) if self._store.check([f"{base}/in/{r}"])]
            settled = all(r in arrived or not self._store.check(
                [self._alive_key(self.generation, r)]) for r in range(self.size))
            if settled or time.monotonic() >= deadline:
                return arrived
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def allreduce_min(self, value: int) -> int:
        return min(self.allgather(int(value)))

    def spawn(self, count: int, hosts=None) -> "StoreRendezvous":
        """Admit up to `count` replacements waiting in the store now (the launcher or a
        scheduler started them; none waits here for more): rank 0 picks them, every rank
        learns which, and they take the ranks after this generation's."""
        self._require_recoverable()
        picked = self.bcast(self._pick_joiners(count) if self.rank == 0 else None)
        generation, size = self.generation + 1, self.size + len(picked)
        if self.rank == 0:
            for i, joiner in enumerate(picked):
                place = {"generation": generation, "rank": self.size + i, "size": size}
                self._store.set(f"{self._root}/join/{joiner}/admit",
                                json.dumps(place).encode())
        successor = self._next(self.rank, size, generation)
        self._hand_over()
        return successor

    def _hand_over(self) -> None:
        """This rank has moved on to the next generation (made before this is called, so
        that the rank is alive in one all along): this one's liveness key goes and its
        hold on the store passes to the next, so that closing the newest rendezvous
        closes the store, and a long job's store does not keep a key per generation."""
        self._store.delete_key(self._alive_key(self.generation, self.rank))
        self.close()

    def joiners_waiting(self) -> int:
        """Replacements registered and not yet admitted (some may have died since)."""
        registered = self._store.add(f"{self._root}/join/count", 0)
        return max(registered - self._store.add(f"{self._root}/join/taken", 0), 0)

    def _pick_joiners(self, count: int) -> List[str]:
        registered = self._store.add(f"{self._root}/join/count", 0)
        taken = self._store.add(f"{self._root}/join/taken", 0)
        picked, seen = [], taken
        while seen < registered and len(picked) < count:
            seen += 1
            joiner = self._store.get(f"{self._root}/join/n{seen}").decode("ascii", "replace")
            self._store.delete_key(f"{self._root}/join/n{seen}")  # (read once: by rank 0)
            if self._store.check([f"{self._root}/join/alive/{joiner}"]):
                picked.append(joiner)  # (one that died while waiting is passed over)
        self._store.add(f"{self._root}/join/taken", seen - taken)
        return picked

    @classmethod
    def join(cls, store, secret: Optional[bytes], prefix: str = DEFAULT_PREFIX,
             timeout: Optional[float] = None) -> "StoreRendezvous":
        """A replacement's way in: register, and wait until the job admits it (at its
        next commit, or recovery), which gives it its rank, the size and the generation."""
        joiner = secrets.token_hex(8)
        store.hold(f"{prefix}/join/alive/{joiner}")
        number = store.add(f"{prefix}/join/count", 1)
        store.set(f"{prefix}/join/n{number}", joiner.encode())
        admission = f"{prefix}/join/{joiner}/admit"
        while not store.check([admission]):
            if store.check([f"{prefix}/finished"]):
                raise JobFinished("ringsync: the job finished before this replacement "
                                  "could join it")
            time.sleep(0.05)
        place = _placement(store.get(admission))
        store.delete_key(admission)
        return cls(store, place["rank"], place["size"], prefix, timeout, secret=secret,
                   owns_store=True, elastic=True, generation=place["generation"])

    def finish(self) -> None:
        """The job ended in order: replacements still waiting to join give up."""
        if self.recoverable:
            self._store.set(f"{self._root}/finished", b"1")

    def _require_recoverable(self) -> None:
        if not self.recoverable:
            raise CommunicationError(
                "ringsync: this store rendezvous cannot recover a lost rank: it needs "
                "RINGSYNC_ELASTIC=1 and ringsync's tcp:// store (ringsync run --elastic)")


def _rank_list(data: bytes, size: int, what: str) -> List[int]:
    """A JSON list of distinct ranks below size, sorted, not empty; else an error."""
    try:
        ranks = json.loads(data)
    except ValueError:
        ranks = None
    if not (isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks)
            and ranks == sorted(set(ranks)) and 0 <= ranks[0] and ranks[-1] < size):
        raise CommunicationError(f"ringsync: {what} in the store is not a list of ranks "
                                 f"below {size}: {data[:100]!r}")
    return ranks


def _placement(data: bytes) -> dict:
    try:
        place = json.loads(data)
        generation, rank, size = place["generation"], place["rank"], place["size"]
        if all(type(v) is int for v in (generation, rank, size)) and 0 <= rank < size \
                and generation > 0:
            return place
    except (ValueError, KeyError, TypeError):
        pass
    raise CommunicationError(f"ringsync: the job's admission in the store is not a place "
                             f"in the job: {data[:100]!r}")
