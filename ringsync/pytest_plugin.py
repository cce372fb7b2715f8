"""pytest plugin: ``@pytest.mark.ranks(n)`` runs a test function on n MPI ranks.

::

    import pytest
    from mpi4py import MPI

    @pytest.mark.ranks(4)
    def test_sum_of_ranks():
        comm = MPI.COMM_WORLD
        assert comm.allreduce(comm.Get_rank()) == 6

pytest does not call such a function itself: it runs it with ``ringsync.testing.run_mpi``,
where each rank imports the test module and calls the function, and the test passes when
every rank returned. A failure shows every rank's outcome and traceback and the job's
output; past the deadline the ranks dump their Python stacks and are killed.

``ranks(n, timeout=120, env=None, mpirun_args=())``
    n            the number of ranks, or a list of them: one test per count (ids np2, np4)
    timeout      seconds for the whole job
    env          variables for the ranks (a None value removes one)
    mpirun_args  extra mpirun options, e.g. ("--with-ft", "ulfm")

A marker on a class or a module (``pytestmark``) gives defaults: the closest marker wins
for each keyword, and env dicts are merged. A test runs on ranks only when some marker
gives it a rank count. Without mpirun the test is skipped.

The ranks cannot run fixtures, so the function may only take arguments whose values can
be sent to them: ``tmp_path`` (or any ``pathlib.Path``; one directory, made by pytest,
shared by all ranks), ``rank_count`` (the number of ranks), and parametrize values or
fixtures that survive ``repr`` -> ``ast.literal_eval`` (numbers, strings, bytes, None,
and lists, tuples, dicts and sets of them). Others (monkeypatch, capsys, request, ...)
fail the test. Autouse fixtures run in pytest's process only. pytest.skip() or
pytest.importorskip() in a rank skips the test, unless another rank failed.

The ``pytest11`` entry point registers the plugin wherever ringsync is installed; with
plugin autoloading off, use ``-p ringsync.pytest_plugin`` or
``pytest_plugins = ["ringsync.pytest_plugin"]``. Under ``mpirun -np N pytest`` (pytest
itself already on ranks) the marker does nothing: each test runs in place.
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import sys

import pytest

# ringsync.testing is imported where it is used: pytest loads this plugin in every session
# wherever ringsync is installed, and tests that do not use the marker should not pay for
# (or break with) more of ringsync than its package.

MARKER = "ranks"
COUNT_FIXTURE = "rank_count"
DEFAULT_TIMEOUT = 120.0
RANK_ENTRY = __name__ + ":run_test_on_rank"
# World sizes that Open MPI's and MPICH's (or Slurm's PMI) launchers give their ranks.
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


class SkippedOnRank(Exception):
    """pytest.skip() in a rank. The rank still fails hard, so that no peer waits for it;
    the parent reads this exception's name in the rank's traceback and skips the test."""


SKIP_LINE = re.compile(r"^%s: (.*)$" % re.escape(f"{__name__}.{SkippedOnRank.__qualname__}"),
                       re.MULTILINE)


# =========================================================================== pytest side


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "ranks(n, timeout=120, env=None, mpirun_args=()): run the test function on n MPI "
        "ranks under mpirun (n may be a list: one test per count); see ringsync.pytest_plugin",
    )


def pytest_generate_tests(metafunc):
    """ranks([1, 2, 4]): one test per rank count, through the rank_count fixture."""
    options = ranks_options(metafunc.definition)
    if options is None or isinstance(options["n"], int):
        return
    if COUNT_FIXTURE not in metafunc.fixturenames:
        metafunc.fixturenames.append(COUNT_FIXTURE)
    metafunc.parametrize(COUNT_FIXTURE, options["n"], indirect=True,
                         ids=["np%d" % n for n in options["n"]])


@pytest.fixture
def virtual_hosts():
    """A maker of ringsync.testing.VirtualHosts (network namespaces as hosts): call it
    with VirtualHosts' arguments; every set made is removed after the test, also when it
    fails. Skips the test where hosts cannot be made (not root, no `ip`)::

        def test_two_hosts(virtual_hosts):
            hosts = virtual_hosts(2, rate="2gbit")
            assert_mpi_ok(body, np=4, hosts=hosts, slots=2)
    """
    from ringsync import netns

    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    made = []

    def make(*args, **kwargs):
        made.append(netns.VirtualHosts(*args, **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()


@pytest.fixture
def rank_count(request) -> int | None:
    """The number of ranks this test runs on (None for a test without a ranks marker)."""
    if hasattr(request, "param"):
        return request.param
    options = ranks_options(request.node)
    return options["n"] if options else None


def pytest_collection_modifyitems(items):
    """A ranks test implies requires_mpirun: skipped, not failed, where none is installed."""
    no_mpirun = pytest.mark.skip(reason="no mpirun installed")
    for item in items:
        if ranks_options(item) is not None and not inside_a_rank() and mpirun_path() is None:
            item.add_marker(no_mpirun)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    options = ranks_options(pyfuncitem)
    if options is None or inside_a_rank():
        return None  # pytest calls the function here, as usual
    from ringsync import testing

    target = target_of(pyfuncitem)
    result = testing.run_mpi(
        RANK_ENTRY,
        np=rank_count_of(pyfuncitem, options),
        timeout=options["timeout"],
        # The sys.path entry pytest imported the test from, which the ranks lack.
        args=(target, encode_arguments(pyfuncitem), testing.target_root(target) or ""),
        env=options["env"],
        mpirun_args=options["mpirun_args"],
    )
    result.target = pyfuncitem.nodeid  # the report names the test, not RANK_ENTRY
    if not result.ok:
        reason = skip_reason(result)
        if reason is not None:
            pytest.skip(reason)  # pytest shows this line as where the test skipped
        pytest.fail(result.report(), pytrace=False)
    return True


def ranks_options(node) -> dict | None:
    """The test's ranks markers merged (closest wins), or None when none gives a count."""
    options = {"n": None, "timeout": DEFAULT_TIMEOUT, "mpirun_args": ()}
    env = {}
    # iter_markers yields the closest first (function, class, module): apply it last.
    for marker in reversed(list(node.iter_markers(MARKER))):
        try:
            given = marker_arguments(*marker.args, **marker.kwargs)
        except TypeError:
            marker_error("it takes (n, timeout=120, env=None, mpirun_args=()), not %s"
                         % describe(marker))
        env.update(given.pop("env", None) or {})
        options.update(given)
    if options["n"] is None:
        return None
    options["env"] = env
    options["mpirun_args"] = tuple(options["mpirun_args"])
    return options


def marker_arguments(n=None, *, timeout=None, env=None, mpirun_args=None) -> dict:
    """The arguments one ranks marker gives (its signature checks them)."""
    given = dict(n=n, timeout=timeout, env=env, mpirun_args=mpirun_args)
    given = {name: value for name, value in given.items() if value is not None}
    if "n" in given:
        given["n"] = checked_counts(given["n"])
    return given


def checked_counts(n):
    counts = list(n) if isinstance(n, (list, tuple)) else [n]
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                             for c in counts):
        marker_error("n must be a positive int or a non-empty list of them, not %r" % (n,))
    return counts if isinstance(n, (list, tuple)) else n


def describe(marker) -> str:
    given = [repr(a) for a in marker.args] + ["%s=%r" % item for item in marker.kwargs.items()]
    return "ranks(%s)" % ", ".join(given)


def marker_error(text: str):
    # pytrace=False: the message alone, not a traceback through pytest's hook machinery.
    pytest.fail("@pytest.mark.ranks: " + text, pytrace=False)


def rank_count_of(item, options) -> int:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and COUNT_FIXTURE in callspec.params:
        return callspec.params[COUNT_FIXTURE]
    return options["n"]


def inside_a_rank() -> bool:
    """Whether this process already is a rank (of run_mpi, or of `mpirun -np N pytest`)."""
    from ringsync import testing

    if os.environ.get(testing.RANK_ENV):
        return True
    sizes = (os.environ.get(name, "") for name in LAUNCHER_SIZE_VARIABLES)
    return any(size.isdigit() and int(size) > 1 for size in sizes)


@functools.lru_cache(maxsize=None)
def mpirun_path() -> str | None:
    from ringsync.errors import LauncherError
    from ringsync.launch.mpirun import find_mpirun

    try:
        return find_mpirun()
    except LauncherError:
        return None


def target_of(item) -> str:
    """"module:qualname" of the test function, which each rank imports."""
    qualname = item.function.__qualname__
    if "<locals>" in qualname:
        marker_error("ranks import the test by name; %s is not at the top level of its "
                     "module or class" % qualname)
    return "%s:%s" % (item.module.__name__, qualname)


def encode_arguments(item) -> str:
    """The function's arguments as a Python literal: paths as ("path", text), the rest
    as ("value", literal)."""
    encoded = {}
    for name in item._fixtureinfo.argnames:  # what pytest itself would pass
        value = item.funcargs[name]
        if isinstance(value, pathlib.PurePath):
            encoded[name] = ("path", str(value))
        elif survives_repr(value):
            encoded[name] = ("value", value)
        else:
            marker_error("argument %r (%s) cannot be sent to the ranks; they take only "
                         "paths such as tmp_path, rank_count, and values that survive "
                         "repr() -> ast.literal_eval()" % (name, type(value).__name__))
    return repr(encoded)


def survives_repr(value) -> bool:
    try:
        copy = ast.literal_eval(repr(value))
        return type(copy) is type(value) and copy == value
    except Exception:  # any repr that is no literal, or an __eq__ that raises
        return False


def skip_reason(result) -> str | None:
    """Why the test skipped itself, when some rank skipped and no rank failed otherwise
    (its peers were perhaps killed before they reached the same skip: missing)."""
    from ringsync import testing

    if result.timed_out:
        return None
    reasons = []
    for rank, outcome in sorted(result.outcomes.items()):
        if outcome in (testing.OK, testing.MISSING):
            continue
        found = SKIP_LINE.findall(outcome)
        if not found:
            return None
        reasons.append("rank %d: %s" % (rank, found[-1]))
    return reasons[0] if reasons else None


# =========================================================================== rank side


def run_test_on_rank(target: str, arguments: str, import_root: str) -> None:
    """Call the test function with the arguments the parent sent."""
    from ringsync import testing

    if import_root and import_root not in sys.path:
        sys.path.insert(0, import_root)
    module, _, qualname = target.partition(":")
    owner, _, name = qualname.rpartition(".")
    if owner:  # a method: pytest, too, calls it on a fresh instance of its class
        function = getattr(testing.resolve_function(module + ":" + owner)(), name)
    else:
        function = testing.resolve_function(target)
    try:
        function(**decode_arguments(arguments))
    except pytest.skip.Exception as skip:
        raise SkippedOnRank(skip.msg) from None


def decode_arguments(text: str) -> dict:
    return {name: pathlib.Path(value) if kind == "path" else value
            for name, (kind, value) in ast.literal_eval(text).items()}
