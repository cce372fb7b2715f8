"""Shared pytest setup.

ringsync's pytest plugin gives ``@pytest.mark.ranks(n)`` (a test function that runs on n
ranks; it is skipped where no mpirun is installed). Its entry point registers it when
ringsync is installed; naming it here also covers PYTEST_DISABLE_PLUGIN_AUTOLOAD=1.

The ``requires_mpirun`` marker skips other tests that start mpirun themselves (through
ringsync.testing.run_mpi or the launcher) where none is installed, instead of failing them.
"""

import pytest

pytest_plugins = ["ringsync.pytest_plugin"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_mpirun: starts ranks with mpirun; skipped when none is installed"
    )


def pytest_runtest_setup(item):
    from ringsync.pytest_plugin import mpirun_path

    if item.get_closest_marker("requires_mpirun") and mpirun_path() is None:
        pytest.skip("no mpirun installed")
