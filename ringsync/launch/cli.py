"""The ``ringsync`` command: argument parsing (the option table of ``ringsync run``),
``run`` and ``main``, the console script's entry point.

``ringsync run -np N [options] [--] program [args...]``
    builds the command line of the installed ``mpirun`` (ringsync.launch.mpirun) and
    runs it (ringsync.launch.process), returning mpirun's exit status, or 1 where mpirun
    reported success but the ranks' records say the job failed; with ``--launcher
    local|ssh`` (the default where there is no mpirun) it starts the ranks itself
    (ringsync.launch.direct). horovodrun's options
    are taken: those that set a ringsync setting become ``-x RINGSYNC_X=value``
    (mpirun.HOROVODRUN_SETTINGS), the others act on the command (ssh port and identity,
    output files, timestamps, binding, ``--check-build``, ``--config-file``: horovodrun's
    YAML, through ringsync.launch.config_file), and those with no meaning here are
    accepted and reported as ignored (IgnoredAction). The README's "Launching" lists
    them all.
``ringsync doctor``
    the versions and settings report of ringsync.launch.doctor.
``ringsync trace DIR`` / ``ringsync report DIR [--id N]``
    read what the ranks wrote when something went wrong (ringsync.diagnose): where their
    flight records diverge; one hang report merged from its parts.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import warnings

from ringsync.diagnose import (describe_divergence, format_hang_report, load_flight_records,
                               load_hang_parts)
from ringsync.errors import LauncherError
from ringsync.launch import direct, doctor, mpirun, process
from ringsync.launch.diagnostics import JobDiagnostics
from ringsync.launch.config_file import apply_config_file, log_level_type, number_type
from ringsync.launch.mpirun import RunOptions


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
        parser.exit(doctor.doctor())


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
    (("--launcher",),
     dict(dest="launcher", choices=("mpirun", "local", "ssh"),
          help="how the ranks start: mpirun (the default where it is installed), local "
               "(this host, no MPI; the default without mpirun) or ssh (the hosts of -H, "
               "no MPI); local and ssh meet through a store the launcher serves")),
    (("--ssh-agent",),
     dict(dest="ssh_agent", metavar="PROGRAM",
          help="--launcher ssh: a program called as ssh is (PROGRAM HOST COMMAND) instead "
               "of ssh")),
    (("--store-address",),
     dict(dest="store_address", metavar="ADDRESS",
          help="--launcher ssh: the address at which the ranks reach this launcher's "
               "store (default: this host's routable address)")),
    (("-H", "--hosts"),
     dict(dest="hosts", metavar="HOST:SLOTS,...", help="hosts and their slots, as mpirun -H")),
    (("-hostfile", "--hostfile"),
     dict(dest="hostfile", metavar="FILE", help="an mpirun hostfile (HOST slots=N lines)")),
    (("--elastic",),
     dict(action="store_true", help="survive rank failures (mpirun: Open MPI's ULFM, "
                                    "--with-ft ulfm; local and ssh: through the store)")),
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
     dict(dest="slots_per_host", type=number_type(int, positive=True), metavar="S",
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
     dict(dest="ssh_port", type=number_type(int, positive=True), metavar="PORT",
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
     dict(dest="start_timeout", type=number_type(float, positive=True), metavar="SECONDS",
          help="longest time init() may take to connect the ring "
               "(RINGSYNC_START_TIMEOUT_SECONDS)")),
    (("--config-file",),
     dict(dest="config_file", metavar="FILE",
          help="horovodrun's YAML file (params, timeline, stall_check, logging, ...); "
               "options on the command line win")),
    # tuning
    (("--fusion-threshold-mb",),
     dict(dest="fusion_threshold_mb", type=number_type(float), metavar="MB",
          help="fuse allreduces up to MB MiB into one pass; 0: no fusion "
               "(RINGSYNC_FUSION_THRESHOLD, in bytes)")),
    (("--cycle-time-ms",),
     dict(dest="cycle_time_ms", type=number_type(float), metavar="MS",
          help="longest wait for more tensors to fuse with (RINGSYNC_CYCLE_TIME_MS)")),
    (("--cache-capacity",),
     dict(dest="cache_capacity", type=number_type(int), metavar="N",
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
     dict(dest="autotune_warmup_samples", type=number_type(int), metavar="N",
          help="samples discarded before tuning (RINGSYNC_AUTOTUNE_WARMUP_SAMPLES)")),
    (("--autotune-steps-per-sample",),
     dict(dest="autotune_steps_per_sample", type=number_type(int, positive=True), metavar="N",
          help="training steps per sample (RINGSYNC_AUTOTUNE_STEPS_PER_SAMPLE)")),
    (("--autotune-bayes-opt-max-samples",),
     dict(dest="autotune_bayes_opt_max_samples", type=number_type(int, positive=True),
          metavar="N", help="most samples after the warm-up (RINGSYNC_AUTOTUNE_MAX_SAMPLES; "
                            "ringsync searches candidates one setting at a time, no "
                            "Bayesian model)")),
    # stalls and logging
    (("--no-stall-check",),
     _flag("no_stall_check", True, "no stall reports (RINGSYNC_STALL_CHECK_SECONDS=0)")),
    (("--stall-check",), _flag("no_stall_check", False, argparse.SUPPRESS)),
    (("--stall-check-warning-time-seconds",),
     dict(dest="stall_check_warning_time_seconds", type=number_type(float), metavar="SECONDS",
          help="report a tensor some ranks have not submitted after SECONDS "
               "(RINGSYNC_STALL_CHECK_SECONDS)")),
    (("--stall-check-shutdown-time-seconds",),
     dict(dest="stall_check_shutdown_time_seconds", type=number_type(float), metavar="SECONDS",
          help="fail (CommunicationTimeout: the job ends with an error) once a tensor has "
               "waited SECONDS for other ranks, or a wait made no progress that long; 0: "
               "never (RINGSYNC_TIMEOUT_SECONDS)")),
    (("--log-level",),
     dict(dest="log_level", type=log_level_type, metavar="LEVEL",
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
     _ignored("ringsync's allgather goes hierarchical with the allreduce's setting "
              "(--hierarchical-allreduce, RINGSYNC_HIERARCHICAL_ALLREDUCE)", _SWITCH)),
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
    commands = parser.add_subparsers(dest="command", metavar="{run,doctor,trace,report}")
    run_parser = commands.add_parser(
        "run",
        help="start a program on N ranks (mpirun, or this host, or ssh)",
        usage="ringsync run -np N [--launcher mpirun|local|ssh] [-H HOST:SLOTS,...] "
              "[--hostfile FILE] [--elastic "
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
    add_diagnose_commands(commands)
    return parser, run_parser


def add_diagnose_commands(commands) -> None:
    trace_parser = commands.add_parser(
        "trace", help="say where the ranks diverged, from their flight records")
    trace_parser.add_argument("directory", metavar="DIR",
                              help="the directory holding the ranks' rank-<R>.json")
    report_parser = commands.add_parser(
        "report", help="merge the parts of a hang report into one")
    report_parser.add_argument("directory", metavar="DIR",
                               help="the directory holding hang-<id>-rank-<R>.json")
    report_parser.add_argument("--id", dest="report", type=int, metavar="N",
                               help="report N (default: the latest)")


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


def choose_launcher(options: RunOptions) -> str:
    """The launcher asked for; else mpirun where it is installed, else local (or ssh
    with -H)."""
    if options.launcher:
        return options.launcher
    try:
        mpirun.find_mpirun()
        return "mpirun"
    except LauncherError:
        return "ssh" if options.hosts else "local"


def run(options: RunOptions) -> int:
    for note in options.ignored:
        print("ringsync run: ignored: " + note, file=sys.stderr, flush=True)
    options.launcher = choose_launcher(options)
    if options.launcher != "mpirun":
        return run_without_mpi(options)
    mpirun_path = mpirun.find_mpirun()
    status_dir = None if options.dry_run else tempfile.mkdtemp(prefix="ringsync-job-")
    diagnostics = None if options.dry_run else JobDiagnostics(options.np)
    status = 1
    try:
        if diagnostics is not None:
            diagnostics.start()  # (before the command: mpirun exports the environment)
        command = mpirun.build_mpirun_command(options, mpirun_path, job_status_dir=status_dir)
        if options.verbose:
            print(doctor.describe_run(options, command), file=sys.stderr, flush=True)
        if options.dry_run:
            print(shlex.join(command))
            return 0
        output = None
        if options.output_filename and mpirun.mpi_flavor(mpirun_path) == mpirun.OPEN_MPI:
            output = process.OutputFiles(options.output_filename, options.np)
        status, message = process.job_status(
            process.run_forwarding_signals(command, output, diagnostics=diagnostics),
            process.read_job_records(status_dir))
        if message:
            print(message, file=sys.stderr, flush=True)
        return status
    finally:
        if status_dir:
            shutil.rmtree(status_dir, ignore_errors=True)
        finish_diagnostics(diagnostics, status)


def finish_diagnostics(diagnostics, status: int) -> None:
    """After the job: the reports still to print, and after a failure where the ranks
    diverged (their flight records)."""
    if diagnostics is None:
        return
    diagnostics.stop()
    if status != 0:
        diagnostics.explain_failure()
    diagnostics.close(failed=status != 0)


def run_without_mpi(options: RunOptions) -> int:
    """--launcher local|ssh: ranks started here or through ssh, meeting at our store."""
    if options.launcher == "ssh" and not options.hosts:
        raise LauncherError("--launcher ssh needs -H HOST:SLOTS,...")
    if options.hostfile or options.mpi_args or options.host_discovery_script:
        given = [flag for flag, value in (("--hostfile", options.hostfile),
                                          ("--mpi-args", options.mpi_args),
                                          ("--host-discovery-script",
                                           options.host_discovery_script)) if value]
        raise LauncherError("%s: only with --launcher mpirun" % ", ".join(given))
    if options.dry_run or options.verbose:
        print("ringsync run: %d rank(s), --launcher %s%s: %s" % (
            options.np, options.launcher, " --elastic" if options.elastic else "",
            shlex.join(options.program)), file=sys.stderr, flush=True)
    if options.dry_run:
        return 0
    diagnostics, status = JobDiagnostics(options.np), 1
    try:
        diagnostics.start()
        status = direct.run_direct(options, diagnostics)
        return status
    finally:
        finish_diagnostics(diagnostics, status)


def diagnose(namespace: argparse.Namespace) -> int:
    """``ringsync trace`` / ``ringsync report``: print what the files say; 2 where there is
    no directory or nothing of that kind in it. Files skipped as unreadable are named on
    stderr either way (the reason there may be nothing to read)."""
    text, problem = None, None
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always")
        try:
            text = read_and_describe(namespace)
        except OSError as exc:  # no directory, nothing in it, or an --id it does not hold
            problem = exc
    for note in skipped:
        print("ringsync %s: %s" % (namespace.command, note.message), file=sys.stderr)
    if problem is not None:
        print("ringsync %s: error: %s" % (namespace.command, problem), file=sys.stderr)
        return 2
    print(text)
    return 0


def read_and_describe(namespace: argparse.Namespace) -> str:
    if namespace.command == "trace":
        return describe_divergence(load_flight_records(namespace.directory))
    _report_id, parts = load_hang_parts(namespace.directory, namespace.report)
    return format_hang_report(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "run":
            # Parsed by hand first: argparse would try to read the program's own options.
            return run(parse_run_options(argv[1:]))
        parser, _ = make_parser()
        namespace = parser.parse_args(argv)
        if namespace.command == "doctor":
            return doctor.doctor()
        if namespace.command in ("trace", "report"):
            return diagnose(namespace)
        parser.print_help()
        return 2
    except LauncherError as exc:
        print("ringsync: error: %s" % exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
