import os

import pytest

from ringsync.launch import hosts
from ringsync.launch import mpirun as mpirun_module

from .helpers import FAKE_MPIRUN


@pytest.fixture
def fake_mpi(monkeypatch):
    """A pretend Open MPI on a 4-core host, run by a normal user, with no RINGSYNC_* set."""
    monkeypatch.setattr(mpirun_module, "find_mpirun", lambda: FAKE_MPIRUN)
    monkeypatch.setattr(mpirun_module, "mpi_flavor", lambda mpirun: mpirun_module.OPEN_MPI)
    monkeypatch.setattr(hosts, "local_slots", lambda: 4)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for name in list(os.environ):
        if name.startswith("RINGSYNC_"):
            monkeypatch.delenv(name)
