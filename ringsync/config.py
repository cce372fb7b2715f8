"""Settings, read once from RINGSYNC_* environment variables into a Config object.

Each setting is described once, in the metadata of its Config field (a Setting): its
environment variable, help text, bounds, and whether ranks must agree on it. Parsing
(Config.from_env), ``ringsync doctor`` and ``ringsync run --verbose``, the launcher's
exports and the README's settings table all read that one description, so they cannot
drift apart. The README table is settings_table()'s output, checked by
tests/unit/test_settings.py.
"""
import math
import os
import re
from dataclasses import Field, asdict, dataclass, field, fields, replace
from typing import Callable, List, Mapping, Optional, Tuple

from .errors import UsageError

ENV_PREFIX = "RINGSYNC_"
# Largest values the native core can take: beyond them cffi fails at init() with an
# OverflowError instead of a message naming the variable.
INT32_MAX = 2**31 - 1  # rs_engine_config_t.cache_capacity is a C int
INT64_MAX = 2**63 - 1  # byte counts are int64_t (size_t for the small_* settings)
SPIN_MAX_US = 1e6  # Communicator caps every spin at one second


@dataclass(frozen=True)
class Setting:
    """What a user needs to know about one setting (the metadata of its Config field)."""

    env: str  # the environment variable: RINGSYNC_<FIELD NAME>
    help: str  # what it does: the README table's "meaning" (Markdown, one line)
    unit: str = ""  # numbers: what they count; text: what the text is
    default_text: str = ""  # where the default is a stand-in (None, -1): what it means
    minimum: float = 0  # numbers: the smallest value accepted from the environment
    positive: bool = False  # numbers: 0 itself is refused (minimum is exclusive)
    maximum: Optional[float] = None  # numbers: the largest value accepted
    zero: str = ""  # numbers: what 0 means, where it is special ("off", "no limit")
    choices: Tuple[str, ...] = ()  # text: the values that work (checked by init())
    agreed: bool = False  # every rank must have the same value (init() compares them)
    # Horovod's variables for the same thing, in order of precedence: read when the
    # RINGSYNC_ variable is unset (see setting_source).
    aliases: Tuple["Alias", ...] = ()


def _same(text: str) -> Optional[str]:
    return text


def horovod_true(text: str) -> bool:
    """Horovod's reading of a flag variable: strtol(text) > 0 ("1" on, "0" or "true" off)."""
    match = re.match(r"\s*([+-]?\d+)", text)
    return bool(match) and int(match.group(1)) > 0


@dataclass(frozen=True)
class Alias:
    """A Horovod variable that sets a ringsync setting: ``convert`` turns its text into
    the setting's own text (Horovod's units into ringsync's), or None where that value
    says nothing about the setting (it is then skipped)."""

    env: str
    convert: Callable[[str], Optional[str]] = _same
    meaning: str = ""  # for the README where the conversion is not the identity


def _setting(default, env: str, help: str, **info):
    """A Config field carrying its Setting."""
    return field(default=default, metadata={"setting": Setting(env, help, **info)})


LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")


def _horovod_level(text: str) -> str:
    """Horovod reads its log level case-insensitively and takes WARNING for anything else."""
    level = text.strip().lower()
    return level if level in LOG_LEVELS else "warning"


def _horovod_timeline(text: str) -> Optional[str]:
    """HOROVOD_TIMELINE=DYNAMIC only allows start_timeline(), which ringsync always does."""
    return None if text.strip() == "DYNAMIC" else text


def _horovod_flag(text: str) -> str:
    return "1" if horovod_true(text) else "0"


def _horovod_on_off(text: str) -> str:
    return "on" if horovod_true(text) else "off"


def _horovod_disable(text: str) -> Optional[str]:
    """HOROVOD_STALL_CHECK_DISABLE=1: no stall reports (0 seconds); 0 says nothing."""
    return "0" if horovod_true(text) else None


_DEAD_PEER_NOTE = (
    "By default there is none (as in Horovod): a stall is reported after "
    "`RINGSYNC_STALL_CHECK_SECONDS`, and a dead peer is noticed through its socket anyway, "
    "so a long rank-0-only evaluation or checkpoint does not tear the ring down")


@dataclass(frozen=True)
class Config:
    timeout_seconds: float = _setting(
        0.0, "RINGSYNC_TIMEOUT_SECONDS", unit="seconds", zero="no limit",
        aliases=(Alias("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),),
        help="a hard limit, opt-in: longest wait without progress, or for other ranks to "
             "submit a tensor, before `CommunicationTimeout`. " + _DEAD_PEER_NOTE)
    start_timeout_seconds: float = _setting(
        120.0, "RINGSYNC_START_TIMEOUT_SECONDS", unit="seconds", positive=True,
        aliases=(Alias("HOROVOD_START_TIMEOUT"),),
        help="longest time `init()` may take to connect the ring")
    iface: Optional[str] = _setting(
        None, "RINGSYNC_IFACE", unit="interfaces or IP addresses",
        default_text="(tested: see below)", aliases=(Alias("HOROVOD_GLOO_IFACE"),),
        help="interface names (`eth0`) or IP addresses to listen on and advertise, "
             "comma-separated in order of preference (`ib0,eth0`): the first present on "
             "this host that every other host reaches. Unset: the host name's address, "
             "then the other interfaces; where hosts have several, the ranks test which "
             "one the other hosts can connect to")
    fusion_threshold: int = _setting(
        64 << 20, "RINGSYNC_FUSION_THRESHOLD", unit="bytes", maximum=INT64_MAX,
        zero="no fusion", agreed=True, aliases=(Alias("HOROVOD_FUSION_THRESHOLD"),),
        help="bytes of allreduces (same dtype, op and scale factors) fused into one ring "
             "pass. Larger tensors run alone")
    cycle_time_ms: float = _setting(
        1.0, "RINGSYNC_CYCLE_TIME_MS", unit="ms", zero="no wait",
        aliases=(Alias("HOROVOD_CYCLE_TIME"),),
        help="longest wait for more asynchronous tensors to fuse with; the wait ends early "
             "when submissions pause (100 µs) or a caller waits, so a lone synchronous "
             "call never pays it")
    overlap: str = _setting(
        "auto", "RINGSYNC_OVERLAP", choices=("auto", "on", "off"), agreed=True,
        help="torch `DistributedOptimizer`: `on` starts each gradient's allreduce during "
             "backward, as soon as it is ready (Horovod's and DDP's way); `off` reduces "
             "every gradient at `step()`, one allreduce per dtype on the calling thread. "
             "`auto`: `off` where every rank is on one host with fewer than two cores "
             "per rank (the reduction could only take cores from backward), else `on`. "
             "Read case-insensitively")
    autotune: int = _setting(
        0, "RINGSYNC_AUTOTUNE", maximum=1, agreed=True,
        aliases=(Alias("HOROVOD_AUTOTUNE", _horovod_flag, "> 0: 1"),),
        help="`1`: tune the fusion threshold, the cycle time and the allreduce crossovers "
             "(`RINGSYNC_SMALL_ALLREDUCE_BYTES`, `RINGSYNC_STAGED_BYTES`) during the first "
             "training steps, every rank applying the same choice; see "
             "[Autotune](#autotune)")
    autotune_log: Optional[str] = _setting(
        None, "RINGSYNC_AUTOTUNE_LOG", unit="file path", default_text="(none)",
        aliases=(Alias("HOROVOD_AUTOTUNE_LOG"),),
        help="rank 0 writes each autotune sample (settings, step time) and the final choice "
             "with its reason to this CSV file")
    autotune_warmup_samples: int = _setting(
        3, "RINGSYNC_AUTOTUNE_WARMUP_SAMPLES", unit="samples", agreed=True,
        aliases=(Alias("HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),),
        help="autotune: samples measured and discarded before tuning starts")
    autotune_steps_per_sample: int = _setting(
        10, "RINGSYNC_AUTOTUNE_STEPS_PER_SAMPLE", unit="steps", positive=True, agreed=True,
        aliases=(Alias("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"),),
        help="autotune: training steps timed per sample")
    autotune_max_samples: int = _setting(
        20, "RINGSYNC_AUTOTUNE_MAX_SAMPLES", unit="samples", positive=True, agreed=True,
        aliases=(Alias("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"),),
        help="autotune: most samples measured after the warm-up (the search ends earlier "
             "once every candidate was tried)")
    stall_check_seconds: float = _setting(
        60.0, "RINGSYNC_STALL_CHECK_SECONDS", unit="seconds", zero="never",
        aliases=(Alias("HOROVOD_STALL_CHECK_DISABLE", _horovod_disable, "`1`: 0 (never)"),
                 Alias("HOROVOD_STALL_CHECK_TIME_SECONDS")),
        help="report tensors that some ranks have not submitted (rank 0, on stderr, a "
             "warning: not at `RINGSYNC_LOG_LEVEL` `error` or `fatal`). To end the job "
             "after a stall, as Horovod's `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`, set "
             "`RINGSYNC_TIMEOUT_SECONDS`")
    cache_capacity: int = _setting(
        4096, "RINGSYNC_CACHE_CAPACITY", unit="tensors", maximum=INT32_MAX,
        zero="no cache", agreed=True, aliases=(Alias("HOROVOD_CACHE_CAPACITY"),),
        help="tensors whose negotiation is remembered: a repeat costs one bit instead of "
             "its metadata")
    timeline: Optional[str] = _setting(
        None, "RINGSYNC_TIMELINE", unit="file path", default_text="(off)",
        aliases=(Alias("HOROVOD_TIMELINE", _horovod_timeline, "`DYNAMIC`: (off)"),),
        help="write a Chrome-trace timeline of every rank to this one file (rank 0 writes "
             "it at `stop_timeline()` or `shutdown()`) from `init()` on; see "
             "[Timeline](#timeline)")
    timeline_mark_cycles: int = _setting(
        0, "RINGSYNC_TIMELINE_MARK_CYCLES", maximum=1,
        aliases=(Alias("HOROVOD_TIMELINE_MARK_CYCLES", _horovod_flag, "> 0: 1"),),
        help="1 marks the start of each of the engine's negotiation rounds (`CYCLE_START`) "
             "in the timeline")
    flight_recorder_size: int = _setting(
        512, "RINGSYNC_FLIGHT_RECORDER_SIZE", unit="collectives", maximum=1 << 16,
        zero="none kept, nor straggler events",
        help="the flight recorder: each rank keeps its last collectives (name, kind, dtype, "
             "shape, times, outcome) in memory; see [When a job hangs or crawls]"
             "(#when-a-job-hangs-or-crawls)")
    flight_recorder_dir: Optional[str] = _setting(
        None, "RINGSYNC_FLIGHT_RECORDER_DIR", unit="directory", default_text="(not written)",
        help="where each rank writes its flight records (`rank-R.json`) when a collective "
             "fails, times out or is aborted, or the rank gets SIGTERM; `ringsync trace DIR` "
             "says where the ranks diverged. `ringsync run` sets one for its job")
    hang_report_dir: Optional[str] = _setting(
        None, "RINGSYNC_HANG_REPORT_DIR", unit="directory",
        default_text="(`ringsync-hang-<job>` in the temporary directory)",
        help="where each rank writes its part of a hang report (on a stall, or `SIGUSR1`); "
             "`ringsync report DIR` merges them (`ringsync run` prints the merged table "
             "itself)")
    hang_report_merged_by: str = _setting(
        "rank0", "RINGSYNC_HANG_REPORT_MERGED_BY", choices=("rank0", "launcher"),
        help="who prints a hang report's merged table: rank 0, on stderr, once the parts "
             "on its host are in; `launcher`: `ringsync run` (which sets it)")
    straggler_report_seconds: float = _setting(
        0.0, "RINGSYNC_STRAGGLER_REPORT_SECONDS", unit="seconds", zero="never",
        help="rank 0 looks this often at who kept the others waiting, and logs a line when "
             "one rank did by more than `RINGSYNC_STRAGGLER_THRESHOLD_MS` per round")
    straggler_threshold_ms: float = _setting(
        5.0, "RINGSYNC_STRAGGLER_THRESHOLD_MS", unit="ms",
        help="the wait per negotiation round (mean over the rounds since the last look) "
             "above which a straggler is logged")
    transport: str = _setting(
        "auto", "RINGSYNC_TRANSPORT", choices=("auto", "tcp", "shm"), agreed=True,
        help="`auto`: shared memory with same-host peers (TCP, with a warning, where "
             "`/dev/shm` has no room), TCP with the others; `tcp`: TCP only; `shm`: shared "
             "memory only (every rank on one host with room in `/dev/shm`, else `init()` "
             "fails naming the rank). Read case-insensitively")
    # -1 (auto) cannot come from the environment: unset the variable for it.
    spin_us: float = _setting(
        -1.0, "RINGSYNC_SPIN_US", unit="µs", maximum=SPIN_MAX_US, default_text="(auto)",
        help="how long a wait on a same-host peer spins before it blocks. Auto: 20 where "
             "the host has two cores per local rank, else 0 (on 2 cores with 2 ranks "
             "spinning made nothing faster)")
    # No upper bound: the lane posts whole buffers only up to RS_LANE_MAX_BYTES (256 KiB,
    # native/src/transport.h) and stages larger allreduces through shared memory in chunks,
    # so any size works; the default sends every blocking allreduce there.
    lane_bytes: int = _setting(
        1 << 30, "RINGSYNC_LANE_BYTES", unit="bytes", maximum=INT64_MAX, zero="no lane",
        agreed=True,
        help="every rank on one host: blocking allreduces up to this size run on the "
             "[lane](#ranks-on-one-host), on the calling thread: up to "
             "`RINGSYNC_SMALL_ALLREDUCE_BYTES` (at most 256 KiB) each rank posts its whole "
             "buffer in one round, larger ones are staged through shared memory in 256 KiB "
             "chunks. Larger allreduces, and every other collective, go to the engine")
    staged_bytes: int = _setting(
        1 << 20, "RINGSYNC_STAGED_BYTES", unit="bytes", maximum=INT64_MAX,
        zero="always the ring", agreed=True,
        help="every rank on one host: the engine reduces allreduces of at least this size "
             "through shared memory (each rank reduces a slice of every rank's data) "
             "instead of the ring")
    lane_spin_us: float = _setting(
        -1.0, "RINGSYNC_LANE_SPIN_US", unit="µs", maximum=SPIN_MAX_US, default_text="(auto)",
        help="how long a wait on the lane, or in a staged allreduce, spins before it "
             "sleeps; also how long the engine's waits for same-host peers spin while a "
             "calling thread is blocked waiting for the engine (its core is idle then). "
             "Auto: 500 where the host has a core per local rank (a staged "
             "allreduce waits twice per 256 KiB chunk, and a wait that sleeps costs a "
             "wake-up: 16 MiB measured 1.4-1.7x faster than with 50), else 0")
    small_allreduce_bytes: int = _setting(
        16 << 10, "RINGSYNC_SMALL_ALLREDUCE_BYTES", unit="bytes", maximum=INT64_MAX,
        zero="always the ring", agreed=True,
        help="engine allreduces (the ones not on the lane or staged) up to this size send "
             "every rank's whole buffer to every peer in one round on up to 4 ranks, and "
             "take ⌈log2 N⌉ rounds of recursive doubling (whole buffers, log2 N partners) "
             "on more, instead of the ring's 2(N−1) steps; on the lane, allreduces up to this size (at most 256 KiB) are "
             "posted whole instead of staged. Measured on one host over the shm transport: "
             "no difference up to 64 KiB (the engine's overhead dominates), 1.5–1.8× slower "
             "than the ring from 256 KiB")
    small_gather_bytes: int = _setting(
        1 << 20, "RINGSYNC_SMALL_GATHER_BYTES", unit="bytes", maximum=INT64_MAX,
        zero="always the ring", agreed=True,
        help="allgathers of at most this many bytes in all, the engine's negotiation "
             "rounds among them, take ⌈log2 N⌉ steps (each rank sends what it has gathered "
             "so far to rank − 2^k) instead of the ring's N−1; each rank sends as many bytes "
             "either way when the ranks' parts are equal")
    hierarchical_allreduce: str = _setting(
        "auto", "RINGSYNC_HIERARCHICAL_ALLREDUCE", choices=("auto", "on", "off", "1", "0"),
        agreed=True,
        aliases=(Alias("HOROVOD_HIERARCHICAL_ALLREDUCE", _horovod_on_off, "> 0: `on`, else `off`"),),
        help="ranks on several hosts, the same number (at least 2) on each: an allreduce "
             "reduce-scatters inside each host, allreduces each slice across hosts (all "
             "local ranks at once, so every link is busy) and allgathers inside each host, "
             "instead of one ring over all ranks. `auto`: from "
             "`RINGSYNC_HIERARCHICAL_BYTES` on; `on` (or `1`, as Horovod's "
             "`HOROVOD_HIERARCHICAL_ALLREDUCE=1`): every allreduce; `off` (or `0`): never. "
             "Allgathers (above `RINGSYNC_SMALL_GATHER_BYTES`) and reducescatters follow "
             "the same setting: they gather or reduce-scatter across hosts per local rank "
             "and inside each host over shared memory. Other layouts always take the ring. "
             "Read case-insensitively")
    # Why 1 MiB (reasoned; not swept). Per rank the hierarchical allreduce moves the same
    # bytes as the ring and takes load off the links between hosts, but its cross-host
    # messages are S/(L*H) bytes: below about 1 MiB they are tens of KiB, latency bound
    # either way. Measured across 2 namespace hosts x 2 ranks at 2 Gbit/s
    # (benchmarks/hosts_allreduce.py): at 1 MiB already 1.2x the flat ring, so a lower
    # threshold may pay; the same size as RINGSYNC_STAGED_BYTES until a sweep says more.
    hierarchical_bytes: int = _setting(
        1 << 20, "RINGSYNC_HIERARCHICAL_BYTES", unit="bytes", maximum=INT64_MAX,
        zero="every allreduce above `RINGSYNC_SMALL_ALLREDUCE_BYTES`", agreed=True,
        help="`RINGSYNC_HIERARCHICAL_ALLREDUCE=auto`: allreduces of at least this size go "
             "hierarchical (smaller ones take the ring, or one round up to "
             "`RINGSYNC_SMALL_ALLREDUCE_BYTES`), and so do allgathers and reducescatters "
             "of at least this many bytes in all. Out of each host the ring sends 2(N−1)/N "
             "of the buffer through one connection, the hierarchical allreduce 2(H−1)/H of "
             "it through one per local rank (N ranks, H hosts): 1.5× against 1× on 2 hosts "
             "of 2 ranks (allgather and reducescatter: (N−1)/N against (H−1)/H)")
    deterministic: int = _setting(
        0, "RINGSYNC_DETERMINISTIC", maximum=1, agreed=True,
        help="1: allreduce and reducescatter results are the same bits from run to run for "
             "the same inputs and rank count, whatever the fusion threshold, cycle time, "
             "submission order, crossovers, path (lane or engine) and fusion: every element "
             "is folded in rank order, rank 0's prescaled value first (`Average` divides "
             "after). Large allreduces then exchange even blocks in one round and allgather "
             "them around the ring (the ring's bytes; no hierarchical allreduce across "
             "hosts). Adasum is unchanged; see [Reproducible results](#reproducible-results)")
    host_name: Optional[str] = _setting(
        None, "RINGSYNC_HOST_NAME", unit="name", default_text="(the host name)",
        help="the host this rank reports: ranks reporting the same name count as one host "
             "(`local_rank()`, shared memory)")
    rendezvous: Optional[str] = _setting(
        None, "RINGSYNC_RENDEZVOUS", unit="`mpi`, `env://`, `tcp://HOST:PORT` or `file:///DIR`",
        default_text="(found: see Launching)",
        help="where `init()` meets the other ranks: MPI, the torchrun/PyTorchJob variables, "
             "ringsync's store at HOST:PORT, or a directory every rank shares. Unset: MPI "
             "under mpirun, else the torchrun, then the Slurm variables")
    store_port: int = _setting(
        0, "RINGSYNC_STORE_PORT", unit="port", maximum=65535,
        default_text="`MASTER_PORT`+1; under Slurm from `SLURM_JOB_ID`",
        help="the port of the store rank 0 serves under `env://` or Slurm")
    secret_file: Optional[str] = _setting(
        None, "RINGSYNC_SECRET_FILE", unit="path", default_text="(unset)",
        help="a file (mode 0600) holding the job's secret, which authenticates every request "
             "to ringsync's store; `RINGSYNC_SECRET` gives it directly (never printed). "
             "`ringsync run --launcher local` or `ssh` makes one")
    elastic: int = _setting(
        0, "RINGSYNC_ELASTIC", maximum=1, agreed=True,
        help="1: under a store rendezvous, survivors of a lost rank recover in-process "
             "(`ringsync run --launcher local --elastic`); under MPI, ULFM decides")
    elastic_min_np: int = _setting(
        1, "RINGSYNC_ELASTIC_MIN_NP", unit="ranks", minimum=1, agreed=True,
        help="elastic: end the job when fewer ranks survive (`ringsync run --min-np`)")
    elastic_max_np: int = _setting(
        0, "RINGSYNC_ELASTIC_MAX_NP", unit="ranks", zero="no limit",
        agreed=True, help="elastic: most ranks; caps `--respawn` (`--max-np`)")
    elastic_respawn: int = _setting(
        0, "RINGSYNC_ELASTIC_RESPAWN", maximum=1, agreed=True,
        help="elastic: 1 starts replacement ranks after a loss, back to the original size, or "
             "to `RINGSYNC_ELASTIC_MAX_NP` where that is smaller (`--respawn`)")
    elastic_discovery_script: Optional[str] = _setting(
        None, "RINGSYNC_ELASTIC_DISCOVERY_SCRIPT", unit="path", default_text="(none)",
        agreed=True,
        help="elastic: a program printing the hosts available now, one `host:slots` per "
             "line (`--host-discovery-script`); rank 0 runs it at commits, and the job "
             "grows onto new slots and drops ranks on hosts that went away. Every host it "
             "may name must be in the job's `-H`/`--hostfile`")
    elastic_discovery_seconds: float = _setting(
        1.0, "RINGSYNC_ELASTIC_DISCOVERY_SECONDS", unit="seconds", zero="at every commit",
        help="elastic: run the host discovery script at most this often")
    elastic_slots_per_host: int = _setting(
        1, "RINGSYNC_ELASTIC_SLOTS_PER_HOST", unit="slots", minimum=1,
        help="elastic: the slots of a host that the discovery script names without "
             "`:slots` (`--slots-per-host`)")
    elastic_reset_limit: int = _setting(
        0, "RINGSYNC_ELASTIC_RESET_LIMIT", unit="recoveries", zero="no limit", agreed=True,
        help="elastic: most recoveries before the job ends (`--reset-limit`)")
    log_level: str = _setting(
        "warning", "RINGSYNC_LOG_LEVEL", choices=LOG_LEVELS,
        aliases=(Alias("HOROVOD_LOG_LEVEL", _horovod_level, "any case; unknown: `warning`"),),
        help="the least severe of ringsync's own messages that are printed: `error` or "
             "`fatal` silence its warnings (stall reports, the open-files limit, elastic "
             "recovery), `info` and below add notes (where the timeline went). Read "
             "case-insensitively")
    # Read by ringsync.bootstrap.fault_tolerant(), before any Config exists; described here
    # so that doctor, the launcher and the README know it.
    mpi_ft: Optional[str] = _setting(
        None, "RINGSYNC_MPI_FT", unit="`1`, `true` or `yes` (any case)",
        default_text="(unset)",
        help="elastic: asserts that MPI keeps the survivors running when a rank dies "
             "(another MPI with ULFM; Open MPI says so itself under `--with-ft ulfm`)")
    # Read by ringsync.bootstrap (a rank records how it ends); `ringsync run` sets it.
    job_status_dir: Optional[str] = _setting(
        None, "RINGSYNC_JOB_STATUS_DIR", unit="directory", default_text="(unset)",
        help="set by `ringsync run` for its ranks: where each records how it ended, so that "
             "the launcher's exit status says whether the job failed (under `--with-ft "
             "ulfm` mpirun's own does not)")

    @classmethod
    def some_from_env(cls, names, environ: Mapping[str, str] = os.environ) -> "Config":
        """Only the settings `names` read from the environment, each unreadable one left
        at its default: what is needed before the ring's first exchange, which reports a
        bad value on every rank (a rank that failed alone before it would leave the
        others waiting)."""
        values = {}
        for f, setting in setting_fields():
            name, text = setting_source(setting, environ)
            if f.name in names and name:
                try:
                    values[f.name] = parse_value(f, text, name)
                except UsageError:
                    pass
        return replace(cls(), **values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides) -> "Config":
        """Settings from RINGSYNC_* variables (unset or empty: the default); overrides,
        when not None, win and are not checked."""
        values = {}
        for f, setting in setting_fields():
            name, text = setting_source(setting, environ)
            if name:
                values[f.name] = parse_value(f, text, name)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def as_dict(self):
        return asdict(self)

    def choice_problems(self) -> List[str]:
        """In words, each setting whose text is none of its choices (compared in any case);
        init() raises them on every rank."""
        problems = []
        for f, setting in setting_fields():
            value = getattr(self, f.name)
            if setting.choices and str(value).lower() not in setting.choices:
                problems.append(f"{setting.env}={value!r} is not one of "
                                f"{', '.join(setting.choices)}")
        return problems

    def logs(self, level: str) -> bool:
        """Whether a message of ``level`` is printed under this Config's log level (the
        communicator's, read once at init; log_enabled reads the environment instead, for
        messages with no Config at hand)."""
        return log_enabled(level, {"RINGSYNC_LOG_LEVEL": self.log_level})

    def overlap_choice(self) -> Optional[bool]:
        """RINGSYNC_OVERLAP as a choice: True (on), False (off) or None (auto: the adapter
        decides by its own rule)."""
        return {"on": True, "off": False}.get(self.overlap.lower())

    def agreed(self):
        """The settings every rank must share (init() fails naming any that differ)."""
        values = {name: getattr(self, name) for name in AGREED_SETTINGS}
        values["transport"] = values["transport"].lower()  # (read case-insensitively)
        values["hierarchical_allreduce"] = hierarchical_mode(values["hierarchical_allreduce"])
        return values


# RINGSYNC_HIERARCHICAL_ALLREDUCE's spellings, by what they mean.
HIERARCHICAL_SPELLINGS = {"auto": "auto", "on": "on", "1": "on", "off": "off", "0": "off"}


def hierarchical_mode(text: str) -> str:
    """'auto', 'on' or 'off' for a RINGSYNC_HIERARCHICAL_ALLREDUCE value (any case), or the
    text itself where it is none of them (init() names it)."""
    return HIERARCHICAL_SPELLINGS.get(text.lower(), text)


def setting_source(setting: Setting, environ: Mapping[str, str]) -> Tuple[Optional[str], str]:
    """(the variable that sets ``setting``, its value in the setting's own terms), or
    (None, "") where none does. RINGSYNC_<NAME> wins; unset or empty, the first of
    Horovod's variables (Setting.aliases) that says something."""
    text = environ.get(setting.env)
    if text:
        return setting.env, text
    for alias in setting.aliases:
        text = environ.get(alias.env)
        converted = alias.convert(text) if text else None
        if converted:
            return alias.env, converted
    return None, ""


def log_enabled(level: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a message of ``level`` (one of LOG_LEVELS) is printed under
    RINGSYNC_LOG_LEVEL (or HOROVOD_LOG_LEVEL); an unknown setting counts as `warning`.
    Read at each call: messages come before and after init(), from any thread."""
    _, text = setting_source(Config.__dataclass_fields__["log_level"].metadata["setting"],
                             environ)
    threshold = text.strip().lower() if text.strip().lower() in LOG_LEVELS else "warning"
    return LOG_LEVELS.index(level) >= LOG_LEVELS.index(threshold)


def setting_fields() -> List[Tuple[Field, Setting]]:
    """Every Config field with its Setting, in Config's order: the one list that parsing,
    doctor, the launcher and the README table walk."""
    return [(f, f.metadata["setting"]) for f in fields(Config)]


def env_of(name: str) -> str:
    """The environment variable of Config field ``name``."""
    return Config.__dataclass_fields__[name].metadata["setting"].env


# Settings that change the wire protocol, an algorithm's choice or the recovery protocol:
# ranks that disagree would reduce different fusions together, misparse negotiation, pick
# different algorithms (a hang) or recover differently. The others (timeouts, stall
# reports, spin times, timeline, interface, host name) are safely per rank.
AGREED_SETTINGS = tuple(f.name for f, setting in setting_fields() if setting.agreed)


def is_number(f: Field) -> bool:
    return isinstance(f.default, (int, float))


def parse_value(f: Field, text: str, name: Optional[str] = None):
    """The value of ``text`` for field ``f``, within its Setting's bounds. ``name``: the
    variable it came from, for messages (default: the setting's own)."""
    setting = f.metadata["setting"]
    name = name or setting.env
    if not is_number(f):
        return text  # choices are checked by init(), where every rank hears of a bad one
    kind = int if isinstance(f.default, int) else float
    try:
        value = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise UsageError(f"{name}={text!r} is not {what}") from None
    if not within_bounds(setting, value):
        raise UsageError(f"{name}={text!r} must be {bounds_in_words(setting)}")
    return value


def within_bounds(setting: Setting, value) -> bool:
    if math.isnan(value) or value < setting.minimum or (setting.positive and value == 0):
        return False
    return setting.maximum is None or value <= setting.maximum


def bounds_in_words(setting: Setting) -> str:
    """The accepted range, for error messages: 'positive', 'zero or more', ..."""
    if setting.positive:
        low = "positive"
    elif setting.minimum == 0:
        low = "zero or more"
    else:
        low = f"{number_text(setting.minimum)} or more"
    if setting.maximum is None:
        return low
    return f"{low} and at most {number_text(setting.maximum)}"


# --------------------------------------------------------------------------- README table

TABLE_HEADER = ("| variable | default | values | ranks agree | Horovod's variable | meaning |\n"
                "|---|---|---|---|---|---|")


def settings_table() -> str:
    """The README's settings table (Markdown), one row per setting."""
    rows = [TABLE_HEADER]
    for f, setting in setting_fields():
        cells = (f"`{setting.env}`", default_in_words(f), values_in_words(f),
                 "yes" if setting.agreed else "", aliases_in_words(setting), setting.help)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def default_in_words(f: Field) -> str:
    """How the README shows a default: what a stand-in means, else the value (with its
    size in KiB/MiB/GiB for byte counts)."""
    setting = f.metadata["setting"]
    if setting.default_text:
        return setting.default_text
    text = number_text(f.default) if is_number(f) else str(f.default)
    if setting.unit == "bytes" and f.default >= 1024:
        text += f" ({_size(f.default)})"
    return text


def aliases_in_words(setting: Setting) -> str:
    """Horovod's variables for a setting, for the README (with any conversion)."""
    return "; ".join(f"`{a.env}`" + (f" ({a.meaning})" if a.meaning else "")
                     for a in setting.aliases)


def values_in_words(f: Field) -> str:
    """The values a setting takes, for the README: choices, or unit and bounds."""
    setting = f.metadata["setting"]
    if setting.choices:
        return ", ".join(f"`{choice}`" for choice in setting.choices)
    if not is_number(f):
        return setting.unit
    low, high = number_text(setting.minimum), setting.maximum
    if high is None:
        span = "> 0" if setting.positive else f"≥ {low}"
    else:
        joiner = "or" if high - setting.minimum == 1 else "to"
        span = f"{low} {joiner} {number_text(high)}"
    text = f"{setting.unit}, {span}" if setting.unit else span
    return text + (f"; 0: {setting.zero}" if setting.zero else "")


def number_text(value) -> str:
    """1.0 → '1', 2**63 - 1 → '2^63−1': short, exact numbers for people."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value > 1 << 20 and (value + 1) & value == 0:
        return f"2^{(value + 1).bit_length() - 1}−1"
    return str(value)


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} bytes"
