"""Strangers at the ranks' listening sockets during init() (issue items 5 and 6).

Port scanners, half greetings and garbage reach every rank's listener before the real
peers: init() must neither wait for them (until RINGSYNC_START_TIMEOUT_SECONDS) nor blame
a healthy rank; each is dropped and logged. Impostors that know the public job id but not
the job's secret greet rank 0 as ranks that have not connected yet: they must be refused
and the real ranks connected. Every job checks an allreduce against the exact sum.

The one-process tests of the handshake itself (replay, reflection, wrong secret, rogue
listener) are in tests/unit/test_auth.py."""
import re

import pytest

from ringsync.testing import assert_mpi_ok

pytestmark = pytest.mark.requires_mpirun

SETTINGS = {
    # Far above the bound the bodies check (rogue_bodies.INIT_LIMIT_S): a setup that
    # waits on a rogue until this timeout fails the test.
    "RINGSYNC_START_TIMEOUT_SECONDS": "30",
    "RINGSYNC_TIMEOUT_SECONDS": "30",
}
JOB_TIMEOUT_S = 90


def dropped(output, rank):
    return re.findall(rf"ringsync: rank {rank}: dropped a connection from [\d.]+:\d+: (.*)",
                      output)


@pytest.mark.parametrize("np,transport", [(3, "auto"), (2, "tcp")])
def test_rogue_clients_neither_stall_nor_fail_init(np, transport):
    result = assert_mpi_ok("tests.faults.rogue_bodies:rogue_clients_do_not_stall_init", np=np,
                           timeout=JOB_TIMEOUT_S,
                           env={**SETTINGS, "RINGSYNC_TRANSPORT": transport})
    # Every rank but the highest accepts, so reads (and drops) its rogues.
    for rank in range(np - 1):
        reasons = dropped(result.output, rank)
        assert "not a ringsync greeting" in reasons, result.report()
        assert "greeting for another job" in reasons, result.report()
        assert any("before any greeting" in why for why in reasons), result.report()
    assert "timed out" not in result.output, result.report()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_impostors_without_the_secret_are_refused(transport):
    result = assert_mpi_ok("tests.faults.rogue_bodies:impostors_with_the_job_id_are_rejected",
                           np=3, timeout=JOB_TIMEOUT_S,
                           env={**SETTINGS, "RINGSYNC_TRANSPORT": transport})
    reasons = dropped(result.output, 0)
    for rank in (1, 2):
        assert f"claims rank {rank} but did not prove that it knows the job's secret" in \
            reasons, result.report()
