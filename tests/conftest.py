"""Shared pytest setup: the ``requires_mpirun`` marker skips multi-rank tests where no
mpirun is installed, instead of failing them."""

import functools
import shutil

import pytest


@functools.lru_cache(maxsize=None)
def mpirun_path():
    try:
        from ringsync.launcher import LauncherError, find_mpirun
    except Exception:  # a broken package must not break collection of every test
        return shutil.which("mpirun")
    try:
        return find_mpirun()
    except LauncherError:
        return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_mpirun: starts ranks with mpirun; skipped when none is installed"
    )


def pytest_runtest_setup(item):
    if item.get_closest_marker("requires_mpirun") and mpirun_path() is None:
        pytest.skip("no mpirun installed")
