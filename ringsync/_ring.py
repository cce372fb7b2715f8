"""NativeRing: one native communicator and its engine, built over a rendezvous.

Building a ring: every rank opens a listening socket, the ranks exchange addresses,
settings and setup errors through the rendezvous, rank 0's job keys are broadcast, every
rank connects, and the engine thread starts. Errors travel through the exchanges instead
of being raised where they happen: a rank that raised early would leave its peers waiting
in the rendezvous forever.
"""
import dataclasses
import os
import socket

import numpy as np

from . import _observe, addresses, bootstrap
from ._fastcall import Entry
from ._native import ffi, lib
from .config import Config, hierarchical_mode
from .errors import CommunicationError, UsageError
from .rendezvous import Rendezvous

_TRANSPORT_MODES = {"auto": lib.RS_TRANSPORT_AUTO, "tcp": lib.RS_TRANSPORT_TCP,
                    "shm": lib.RS_TRANSPORT_SHM}
_HIERARCHICAL_MODES = {"auto": lib.RS_HIERARCHICAL_AUTO, "on": lib.RS_HIERARCHICAL_ON,
                       "off": lib.RS_HIERARCHICAL_OFF}


def _cores_per_local_rank(local_size: int) -> float:
    """Cores this rank may count on. A rank bound to one core (Open MPI binds each of two
    ranks to its own core) has that core to itself when the host has a core per rank."""
    host = os.cpu_count() or 1
    own = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else host
    if own == 1 and host >= local_size:
        return 1.0
    return own / local_size


def _address(pointer) -> int:
    return int(ffi.cast("uintptr_t", pointer))


class NativeRing:
    """The native communicator (`c`) and engine (`engine`) of one ring, its topology, and
    their lifetime. `lane`: the engine offers the same-host lane."""

    def __init__(self, rendezvous: Rendezvous, config: Config = None):
        self.rendezvous = rendezvous
        self.rank, self.size = rendezvous.rank, rendezvous.size
        # A bad setting on one rank travels through the first exchange (see _connect).
        self._setup_error = None
        try:
            self.config = config or Config.from_env()
        except UsageError as e:
            self.config, self._setup_error = Config(), ("usage", f"rank {self.rank}: {e}")
        self.c = ffi.NULL
        self.closed = True  # (an attribute, not a test of c: every call reads it)
        self.engine = ffi.NULL
        self.lane = False
        self.entry = None  # the engine's native entry (native/python/fastcall.c) while it runs
        self.observer = None
        self._job_id = 0
        try:
            self._connect()
            self._start_engine()
        except BaseException:
            self.destroy()
            raise

    # ---- building ----

    def _connect(self):
        me, local_error = self._open_listener()
        local_error = self._setup_error or self._choice_error() or local_error
        peers = self.rendezvous.allgather((me, local_error, self.config.agreed()))
        self._raise_if_any_failed([err for _, err, _ in peers], "setting up the listening socket")
        self._raise_if_settings_differ([settings for _, _, settings in peers])
        infos = [info for info, _, _ in peers]
        self.host_names = [p.host_name for p in infos]
        self.addresses = [p.address for p in infos]  # where each rank listens
        self.topology = bootstrap.topology(self.host_names, self.rank)
        self._connect_ring(infos)
        lib.rs_comm_set_spin(self.c, self._spin_seconds())
        lib.rs_comm_set_small_allreduce(self.c, self.config.small_allreduce_bytes)
        lib.rs_comm_set_small_gather(self.c, self.config.small_gather_bytes)
        lib.rs_comm_set_hierarchical(
            self.c, _HIERARCHICAL_MODES[hierarchical_mode(self.config.hierarchical_allreduce)],
            self.config.hierarchical_bytes)
        lib.rs_comm_set_deterministic(self.c, self.config.deterministic)

    def _choice_error(self):
        """None, or a usage error for the settings that are none of their choices."""
        problems = self.config.choice_problems()
        return ("usage", f"rank {self.rank}: " + "; ".join(problems)) if problems else None

    def _spin_seconds(self) -> float:
        """Spinning pays only where the ranks' threads need not share cores: on 2 cores
        with 2 ranks (4 busy threads), a 20 us spin measured no faster for a 4-byte
        allreduce and made training steps slower."""
        if self.config.spin_us >= 0:
            return min(self.config.spin_us, 1e6) * 1e-6
        return 20e-6 if _cores_per_local_rank(self.topology.local_size) >= 2 else 0.0

    def _lane_spin_seconds(self) -> float:
        """The lane's waits run on the calling thread while the engine thread sleeps: one
        busy thread per rank, so spinning pays where each local rank has a core."""
        if self.config.lane_spin_us >= 0:
            return min(self.config.lane_spin_us, 1e6) * 1e-6
        return 500e-6 if _cores_per_local_rank(self.topology.local_size) >= 1 else 0.0

    def _open_listener(self):
        """(this rank's PeerInfo, an error or None). A rank listens only on the address it
        advertises: stray clients elsewhere never reach it."""
        me = bootstrap.PeerInfo(self.config.host_name or socket.gethostname(), "", 0)
        # (collective: before anything that may return early)
        address, error = addresses.choose(self.rendezvous, me.host_name, self.config.iface)
        mode = _TRANSPORT_MODES.get(self.config.transport.lower())
        if mode is None:
            return me, ("usage", f"rank {self.rank}: RINGSYNC_TRANSPORT="
                        f"{self.config.transport!r} is not one of {', '.join(_TRANSPORT_MODES)}")
        if error:
            return me, error
        bind_host = advertised = address
        bootstrap.raise_fd_limit(self.size, self.rank)  # before the ring's sockets
        cptr, port = ffi.new("rs_comm_t **"), ffi.new("int *")
        status = lib.rs_comm_create(self.rank, self.size, bind_host.encode(),
                                    self.config.timeout_seconds,
                                    self.config.start_timeout_seconds, cptr, port)
        self.c = cptr[0]
        self.closed = self.c == ffi.NULL
        if status == lib.RS_OK:
            status = lib.rs_comm_set_transport(self.c, mode)
        me = dataclasses.replace(me, address=advertised, port=port[0])
        return me, self._error_text(status, "creating the ring")

    def _connect_ring(self, infos):
        addresses = bootstrap.connect_addresses(infos)
        keys = self.rendezvous.job_keys()
        self._job_id = keys.job_id
        keep = [ffi.new("char[]", s.encode()) for s in addresses + self.host_names]
        hosts, names = keep[: self.size], keep[self.size:]
        status = lib.rs_comm_connect(self.c, ffi.new("const char *[]", hosts),
                                     ffi.new("int[]", [p.port for p in infos]),
                                     ffi.new("const char *[]", names), keys.job_id,
                                     keys.secret, len(keys.secret))
        errors = self.rendezvous.allgather(self._error_text(status, "connecting the ring"))
        self._raise_if_any_failed(errors, "connecting the ring")

    def _start_engine(self):
        cfg = ffi.new("rs_engine_config_t *", {
            "fusion_threshold_bytes": self.config.fusion_threshold,
            "cycle_time_ms": self.config.cycle_time_ms,
            # Stall reports are warnings: RINGSYNC_LOG_LEVEL=error or fatal silences them.
            "stall_check_seconds": self.config.stall_check_seconds
            if self.config.logs("warning") else 0.0,
            "cache_capacity": self.config.cache_capacity,
            "lane_spin_seconds": self._lane_spin_seconds(),
            "lane_max_bytes": self.config.lane_bytes,
            "staged_min_bytes": self.config.staged_bytes,
            "flight_records": self.config.flight_recorder_size,
            "report_on_stall": 1,
        })
        eptr = ffi.new("rs_engine_t **")
        status = lib.rs_engine_create(self.c, cfg, eptr)
        if status != lib.RS_OK:
            raise CommunicationError(
                f"ringsync.init: {self._error_text(status, 'starting the engine')[1]}")
        self.engine = eptr[0]
        self.lane = bool(lib.rs_engine_has_lane(self.engine))
        # (hot calls on numpy arrays go straight to the core: native/python/fastcall.c)
        self.entry = Entry(_address(self.engine), self.lane, tuple(
            _address(ffi.addressof(lib, f)) for f in ("rs_engine_try_lane", "rs_engine_submit",
                                                      "rs_engine_wait", "rs_engine_release")),
            np.ndarray)
        self.observer = _observe.Observer(self, self._job_id)

    # ---- errors while building ----

    def _error_text(self, status, what):
        """None, or (kind, text) for the allgather that tells every rank who failed."""
        if status == lib.RS_OK:
            return None
        detail = ffi.string(lib.rs_comm_last_error(self.c)).decode("utf-8", "replace") if self.c else ""
        kind = "usage" if status == lib.RS_ERR_USAGE else "comm"
        return kind, f"rank {self.rank}: {what} failed (status {status}): {detail}"

    def _raise_if_settings_differ(self, settings):
        """Every rank raises the same error when a setting that changes the wire protocol
        or an algorithm choice differs between ranks (a variable exported on one host only
        would otherwise give wrong sums or a hang)."""
        problems = []
        for key, mine in settings[0].items():
            differ = [(r, s[key]) for r, s in enumerate(settings) if s[key] != mine]
            if differ:
                r, theirs = differ[0]
                problems.append(f"RINGSYNC_{key.upper()} is {mine!r} on rank 0 but {theirs!r} on "
                                f"rank {r}" + (f" (and {len(differ) - 1} more ranks)"
                                               if len(differ) > 1 else ""))
        if problems:
            raise UsageError("ringsync.init: ranks must agree on these settings (export them "
                             "to every rank, e.g. mpirun -x): " + "; ".join(problems))

    def _raise_if_any_failed(self, errors, what):
        """Every rank raises together: a usage error if all failures were bad settings."""
        failed = [e for e in errors if e]
        if failed:
            cls = UsageError if all(kind == "usage" for kind, _ in failed) else CommunicationError
            raise cls(f"ringsync.init: {what} failed: " + "; ".join(text for _, text in failed))

    # ---- state and teardown ----

    @property
    def broken(self) -> bool:
        return self.c != ffi.NULL and lib.rs_comm_is_broken(self.c) != 0

    @property
    def transport(self) -> str:
        return ffi.string(lib.rs_comm_transport_name(self.c)).decode() if self.c else "closed"

    def traffic(self) -> dict:
        """Bytes sent to each rank since connecting, by transport (rs_comm_traffic)."""
        if self.closed:
            raise UsageError("ringsync: traffic() of a closed communicator")
        tcp, shm = ffi.new("int64_t[]", self.size), ffi.new("int64_t[]", self.size)
        lib.rs_comm_traffic(self.c, tcp, shm)
        return {"tcp": list(tcp), "shm": list(shm)}

    def destroy(self):
        """Free the engine (joining its thread: no buffer is in use after) and the ring."""
        self.lane = False
        if self.entry is not None:
            self.entry.close()
            self.entry = None
        if self.observer is not None:
            self.observer.stop()  # (its thread reads the engine)
            self.observer = None
        if self.engine != ffi.NULL:
            lib.rs_xla_forget(self.engine)  # (compiled JAX programs may name it: xla_ffi.c)
            lib.rs_engine_destroy(self.engine)
            self.engine = ffi.NULL
        if self.c != ffi.NULL:
            lib.rs_comm_destroy(self.c)
            self.c = ffi.NULL
            self.closed = True

    def start_timeline(self, path, mark_cycles=False):
        if lib.rs_engine_start_timeline(self.engine, str(path).encode(),
                                        1 if mark_cycles else 0) != lib.RS_OK:
            detail = ffi.string(lib.rs_engine_last_error(self.engine)).decode("utf-8", "replace")
            raise UsageError(f"ringsync.start_timeline: {detail}")

    def stop_timeline(self):
        lib.rs_engine_stop_timeline(self.engine)

    def shutdown(self):
        """Stop the engine after every healthy rank got here (bounded by the timeout), so
        that no rank's exit looks like a failure to a peer; then free everything."""
        if self.closed:
            return
        lib.rs_engine_shutdown(self.engine)  # a failure here changes nothing: we close
        self.destroy()

    def abort(self, reason: str):
        """Fail every pending collective here and on every peer; free everything."""
        if self.closed:
            return
        lib.rs_engine_abort(self.engine, reason.encode())
        self.destroy()
