"""Settings, read once from RINGSYNC_* environment variables into a Config object."""
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Mapping, Optional

from .errors import UsageError


@dataclass(frozen=True)
class Config:
    # RINGSYNC_TIMEOUT_SECONDS: longest wait without progress (or for other ranks to
    # submit a tensor) before every pending request fails; 0: no hard limit (the default,
    # as in Horovod: stalls are reported, and a dead peer is noticed through its socket)
    timeout_seconds: float = 0.0
    # RINGSYNC_START_TIMEOUT_SECONDS: longest time init() may take to connect the ring
    start_timeout_seconds: float = 120.0
    # RINGSYNC_IFACE: interface name or IP address to listen on and advertise
    iface: Optional[str] = None
    # RINGSYNC_FUSION_THRESHOLD: bytes of allreduces fused into one ring pass (0: off)
    fusion_threshold: int = 64 << 20
    # RINGSYNC_CYCLE_TIME_MS: longest wait for more asynchronous tensors to fuse
    cycle_time_ms: float = 1.0
    # RINGSYNC_STALL_CHECK_SECONDS: report tensors some ranks have not submitted (0: off)
    stall_check_seconds: float = 60.0
    # RINGSYNC_CACHE_CAPACITY: negotiations remembered so repeats cost one bit
    cache_capacity: int = 4096
    # RINGSYNC_TIMELINE: write a Chrome-trace timeline to this file
    timeline: Optional[str] = None
    # RINGSYNC_TRANSPORT: auto (shared memory with same-host peers, TCP with others),
    # tcp, or shm (every peer must be on this host)
    transport: str = "auto"
    # RINGSYNC_SPIN_US: how long a wait on a same-host peer spins before it blocks; -1:
    # 20 us where the host has two cores per local rank (its thread and the engine's), else 0
    spin_us: float = -1.0
    # RINGSYNC_LANE_BYTES: blocking allreduces up to this size (at most 4 MiB) take the
    # same-host lane when every rank is on one host: no engine thread, one exchange through
    # shared memory (0: always the engine)
    lane_bytes: int = 1 << 30
    # RINGSYNC_STAGED_BYTES: with every rank on one host, the engine reduces allreduces of at
    # least this size through the shared segments (each rank reduces a slice of every
    # rank's data) instead of the ring (0: always the ring)
    staged_bytes: int = 1 << 20
    # RINGSYNC_LANE_SPIN_US: how long a wait on the same-host lane or in a staged allreduce
    # spins for its peers before it sleeps; -1: 50 us where the host has a core per local
    # rank, else 0
    lane_spin_us: float = -1.0
    # RINGSYNC_SMALL_ALLREDUCE_BYTES: allreduces up to this size exchange whole buffers in
    # one round instead of running the ring (0: always the ring)
    small_allreduce_bytes: int = 16 << 10
    # RINGSYNC_HOST_NAME: the host name this rank reports; ranks reporting the same name
    # count as one host (local_rank, shared memory). Default: the machine's host name
    host_name: Optional[str] = None
    # RINGSYNC_ELASTIC_MIN_NP: fewest ranks an elastic job goes on with after a failure
    elastic_min_np: int = 1
    # RINGSYNC_ELASTIC_MAX_NP: most ranks an elastic job may have (0: no limit)
    elastic_max_np: int = 0
    # RINGSYNC_ELASTIC_RESPAWN: 1 = start replacement ranks to restore the original size
    elastic_respawn: int = 0
    # RINGSYNC_ELASTIC_RESET_LIMIT: most recoveries before an elastic job gives up (0: none)
    elastic_reset_limit: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides) -> "Config":
        values = {}
        for f in fields(cls):
            text = environ.get("RINGSYNC_" + f.name.upper())
            if text:
                values[f.name] = _parse(f.name, text, f.default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def as_dict(self):
        return asdict(self)

    def agreed(self):
        """The settings every rank must share (init() fails naming any that differ)."""
        values = {name: getattr(self, name) for name in AGREED_SETTINGS}
        values["transport"] = values["transport"].lower()  # (read case-insensitively)
        return values


# Settings that change the wire protocol, an algorithm's choice or the recovery protocol:
# ranks that disagree would reduce different fusions together, misparse negotiation, pick
# different algorithms (a hang) or recover differently. The others (timeouts, stall
# reports, spin times, timeline, interface, host name) are safely per rank.
AGREED_SETTINGS = ("fusion_threshold", "cache_capacity", "transport", "lane_bytes",
                   "staged_bytes", "small_allreduce_bytes", "elastic_min_np",
                   "elastic_max_np", "elastic_respawn", "elastic_reset_limit")


def _parse(field: str, text: str, default):
    name = "RINGSYNC_" + field.upper()
    if default is None or isinstance(default, str):
        return text
    kind = int if isinstance(default, int) else float
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not {'a whole number' if kind is int else 'a number'}") from None
    positive = field == "start_timeout_seconds"
    if value != value or value < 0 or (value == 0 and positive):  # (value != value: NaN)
        raise UsageError(f"{name}={text!r} must be {'positive' if positive else 'zero or more'}")
    return value
