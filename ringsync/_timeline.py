"""The timeline of one communicator: one Chrome-trace JSON file with every rank's events.

Each rank's engine writes its own events (pid = the rank, one track per tensor) to a
private file next to the requested one (``.<name>.rank<r>.<random>.part``). While the
job runs, rank 0 copies its own events from its part into the requested file every half
second, keeping that file valid JSON at every moment (the events so far, then the
closing brackets, which each copy writes over and puts back), so it can be opened while
the job runs, as Horovod's can; it lags by what the engine has not flushed yet. When the
timeline stops (``stop_timeline()`` or ``shutdown()``, both collective then), the ranks
that asked for the same path as rank 0 send their events to rank 0 (an alltoall with
every split but rank 0's empty), which writes the one file; a rank that asked for another
path writes its own events there. Where that exchange cannot happen (a broken ring, an
elastic recovery, a rank gone) each rank keeps its own events in ``<path>.rank<r>`` and
says so on stderr.

Timestamps are each rank's CLOCK_MONOTONIC in µs; events of a rank on another host than
rank 0 are shifted by the difference of the two hosts' wall clocks, so they line up as
well as the hosts' clocks agree.
"""
import codecs
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

from ._pickled import allgather_on
from .config import log_enabled
from .errors import UsageError


def _check_writable(path: str) -> None:
    """Refuse a symbolic link at ``path`` (someone else's file would be overwritten) or a
    place that cannot be written, now rather than when the timeline stops."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UsageError(f"ringsync.start_timeline: cannot open the timeline file (a symbolic "
                         f"link there is refused) '{path}': {exc.strerror}") from None
    os.close(fd)


def _note(text: str, level: str = "warning") -> None:
    if log_enabled(level):
        sys.stderr.write(f"ringsync: {text}\n")
        sys.stderr.flush()


def merge_traces(parts, shifts_us=None) -> dict:
    """One Chrome trace of several ranks' traces (parsed JSON objects), their events
    shifted by ``shifts_us`` (one per part, µs; default none)."""
    events = []
    for i, trace in enumerate(parts):
        shift = shifts_us[i] if shifts_us else 0.0
        for event in trace.get("traceEvents", []):
            if shift and "ts" in event:
                event = dict(event, ts=event["ts"] + shift)
            events.append(event)
    return {"displayTimeUnit": "ms", "traceEvents": events}


def _write_replacing(path: str, data: bytes) -> None:
    """Write ``path`` through a new file renamed over it: a symbolic link there is
    replaced, never followed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_LIVE_SECONDS = 0.5  # how often rank 0 copies its new events into the file


class PartReader:
    """The complete events of a part file that the engine is still writing, each call the
    ones that arrived since the last (the engine writes one event per line, but flushes
    in blocks that may end anywhere, even inside a UTF-8 character)."""

    def __init__(self, path: str):
        self.path, self.offset, self.pending = path, 0, ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def new_events(self) -> list:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        return self.feed(self._decoder.decode(data))

    def feed(self, text: str) -> list:
        """The events (their JSON text) completed by `text`, the next part of the file."""
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()  # (no newline after it yet)
        events = [e for e in map(_event_of, lines) if e is not None]
        last = _event_of(self.pending)  # a whole event whose separator is still to come
        if last is not None:
            events.append(last)
            self.pending = ""
        return events


def _event_of(line: str):
    """The event on one line of a part (its text), or None (the header, the footer, a
    separator, or an event not complete yet)."""
    text = line.strip().strip(",")
    if not text.startswith("{") or text.startswith('{"displayTimeUnit"'):
        return None
    try:
        return text if isinstance(json.loads(text), dict) else None
    except ValueError:
        return None


class LiveFile:
    """A Chrome-trace file that is valid JSON after every append: the header, the events
    so far, the footer (which each append writes over and puts back)."""
    HEAD, FOOT = b'{"displayTimeUnit": "ms", "traceEvents": [\n', b"\n]}\n"

    def __init__(self, path: str):
        # (a symbolic link planted there is refused, as _check_writable does)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW |
                          os.O_CLOEXEC, 0o644)
        os.write(self.fd, self.HEAD + self.FOOT)
        self.end, self.count = len(self.HEAD), 0

    def append(self, events: list) -> None:
        if not events:
            return
        data = ((",\n" if self.count else "") + ",\n".join(events)).encode()
        os.pwrite(self.fd, data + self.FOOT, self.end)  # (one write: readers see either)
        self.end += len(data)
        self.count += len(events)

    def close(self) -> None:
        os.close(self.fd)


class _LiveCopy(threading.Thread):
    """Rank 0's events, from its part into the file the user named, as they come."""

    def __init__(self, part: str, path: str):
        super().__init__(name="ringsync-timeline", daemon=True)
        self.reader, self.out = PartReader(part), LiveFile(path)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(_LIVE_SECONDS):
            self.copy()

    def copy(self) -> None:
        try:
            self.out.append(self.reader.new_events())
        except OSError as exc:  # (a full disk, say: the part still has every event)
            _note(f"the timeline file is no longer updated while the job runs: {exc}")
            self.stopping.set()

    def finish(self) -> None:
        """After the engine closed the part: copy the rest, close the file."""
        self.stopping.set()
        self.join()
        self.copy()
        self.out.close()


class Timeline:
    """The timeline of ``comm`` (a Communicator, whose collectives gather the parts), kept
    by ``ring`` (its NativeRing, whose engine writes this rank's part); at most one at a
    time."""

    def __init__(self, comm, ring):
        self.comm, self.ring = comm, ring
        self.path = None  # what the user asked for
        self.part = None  # where this rank's engine writes
        self.live = None  # rank 0: its events copied into path as they come

    @property
    def active(self) -> bool:
        return self.path is not None

    def start(self, path, mark_cycles: bool = False) -> None:
        path = os.fspath(path)
        if self.active:
            raise UsageError(f"ringsync.start_timeline: a timeline is already being written "
                             f"to '{self.path}'; cannot start '{path}' (stop_timeline() first)")
        _check_writable(path)
        fd, part = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.rank{self.comm.rank()}.", suffix=".part",
            dir=os.path.dirname(os.path.abspath(path)))
        os.close(fd)
        try:
            self.ring.start_timeline(part, mark_cycles)
        except BaseException:
            os.unlink(part)
            raise
        self.path, self.part = path, part
        if self.comm.rank() == 0:
            self._start_live_copy(path, part)

    def _start_live_copy(self, path: str, part: str) -> None:
        try:
            self.live = _LiveCopy(part, path)
        except OSError as exc:  # (a symbolic link planted there since the check, say)
            self.stop(gather=False)
            raise UsageError(f"ringsync.start_timeline: cannot open the timeline file (a "
                             f"symbolic link there is refused) '{path}': {exc.strerror}") \
                from None
        self.live.start()

    def stop(self, gather: bool = True) -> None:
        """Close this rank's events and write the file (collective when ``gather``: every
        rank of the communicator must stop too); without ``gather``, or where gathering
        fails, this rank's events go to ``<path>.rank<r>``."""
        if not self.active:
            return
        path, part, live = self.path, self.part, self.live
        self.path = self.part = self.live = None
        if not self.comm.closed:
            self.ring.stop_timeline()
        if live is not None:
            live.finish()  # (what rank 0's file keeps if the gather below fails)
        try:
            with open(part, "rb") as f:
                mine = f.read()
        except OSError as exc:
            _note(f"rank {self.comm.rank()}: the timeline's events are lost ({exc})")
            return
        if gather and not self.comm.closed and not self.comm.broken:
            try:
                self._gather(path, mine)
                os.unlink(part)
                return
            except Exception as exc:  # a rank gone, a broken ring: keep what we have
                why = f"{type(exc).__name__}: {exc}"
        else:
            why = "the communicator is broken or closed"
        own = f"{path}.rank{self.comm.rank()}"
        os.replace(part, own)
        _note(f"rank {self.comm.rank()}: the timeline could not be gathered to rank 0 ({why}); "
              f"this rank's events are in {own}")

    def _gather(self, path: str, mine: bytes) -> None:
        comm = self.comm
        me = (os.path.abspath(path), comm.host_names[comm.rank()], time.time() - time.monotonic())
        everyone = allgather_on(comm, me, name="ringsync.timeline.ranks")
        joins = everyone[0][0] == me[0]
        send = np.frombuffer(mine if joins else b"", np.uint8)
        splits = [send.size] + [0] * (comm.size() - 1)
        data, sizes = comm.alltoall(send, splits=splits, name="ringsync.timeline.events")
        if not joins:
            _write_replacing(path, mine)  # its own path: its own events
            return
        if comm.rank() != 0:
            return
        data = data.tobytes()
        parts, shifts, start = [], [], 0
        for rank, size in enumerate(int(n) for n in sizes):
            if size:
                parts.append(json.loads(data[start:start + size]))
                host, clock = everyone[rank][1], everyone[rank][2]
                shifts.append((clock - everyone[0][2]) * 1e6 if host != everyone[0][1] else 0.0)
            start += size
        _write_replacing(path, json.dumps(merge_traces(parts, shifts)).encode())
        _note(f"timeline of {len(parts)} ranks written to {path}", "info")
