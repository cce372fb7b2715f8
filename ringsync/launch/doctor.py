"""The settings report and ``ringsync doctor``.

``ringsync doctor`` (and ``ringsync run --check-build``) reports the ringsync, native
core, MPI and framework versions this machine has, and every ringsync setting: its value
and where it comes from (a HOROVOD_* alias named). Frameworks are imported in a child
process whose stderr is dropped. ``ringsync run --verbose`` prints the same settings
report for the job it starts (describe_run).

MPI is never imported at module import time: the launcher process itself must not
become an MPI process (it only starts mpirun). ``doctor`` imports mpi4py lazily and
without calling MPI_Init.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import shlex
import subprocess
import sys

from ringsync.config import (default_in_words, number_text, parse_value, setting_fields,
                             setting_source)
from ringsync.errors import UsageError
from ringsync.launch import mpirun
from ringsync.launch.hosts import available_slots
from ringsync.launch.mpirun import RunOptions, option_settings, unknown_ringsync_variables

FRAMEWORKS = ("torch", "tensorflow", "keras")


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
    lines += ["%-40s %s" % ("%s=%s" % (name, shown_value(name, environ[name])),
                            "environment: not a ringsync setting (exported as is)")
              for name in unknown_ringsync_variables(environ)]
    aliases = {alias.env for _, setting in setting_fields() for alias in setting.aliases}
    lines += ["%-40s %s" % ("%s=%s" % (name, environ[name]),
                            "environment: a Horovod variable ringsync does not read")
              for name in sorted(environ) if name.startswith("HOROVOD_") and name not in aliases]
    return lines


SECRET_VARIABLES = ("RINGSYNC_SECRET",)


def shown_value(name: str, value: str) -> str:
    """A variable's value as a report shows it: never the job's secret."""
    return "(set; never shown)" if name in SECRET_VARIABLES else value


def world_description() -> str:
    """Which world init() would join from this environment, and why."""
    from ringsync.rendezvous_env import find_world
    return find_world(os.environ).describe()


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


# --------------------------------------------------------------------------- doctor


def ringsync_version() -> str:
    # The package is loaded already (this module is part of it): its version is read
    # from sys.modules rather than by importing the package face here.
    return str(sys.modules["ringsync"].__version__)


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
    ompi_info = mpirun.find_mpi_tool("ompi_info")
    if not ompi_info:
        return None
    report = mpirun.tool_output([ompi_info, "--parsable"])
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
    path = mpirun.find_mpirun()
    return "%s (%s)" % (path, mpirun.mpi_flavor(path))


def doctor() -> int:
    rows = [
        ("ringsync", ringsync_version),
        ("native core", native_version),
        ("python", lambda: "%s %s" % (sys.executable, sys.version.split()[0])),
        ("mpirun", mpirun_description),
        ("MPI library", mpi_library),
        ("ULFM fault tolerance", ulfm_support),
        ("world", world_description),
        ("mpi4py", mpi4py_version),
    ]
    rows += [(name, functools.partial(framework_version, name)) for name in FRAMEWORKS]
    for label, describe in rows:
        print("%-22s %s" % (label + ":", guarded(describe)), flush=True)
    print("ringsync settings (value, where from):")
    for line in settings_report():
        print("  " + line)
    return 0
