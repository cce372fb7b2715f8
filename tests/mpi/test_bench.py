"""The benchmark tool runs end to end and reports every library it compares (no figure is
checked: speed is never asserted in tests)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.requires_mpirun


def test_bench_reports_ringsync_mpi_gloo_and_waiting_cpu():
    out = subprocess.run([sys.executable, "-m", "ringsync.bench", "--np", "2", "--max-size", "4K",
                          "--seconds", "0.05"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gloo/ringsync" in out.stdout and "MPI/ringsync" in out.stdout, out.stdout
    assert "4 KiB |" in out.stdout and "% of a core (MPI:" in out.stdout, out.stdout
    assert "ringsync/copy" in out.stdout and "Goals (this run):" in out.stdout, out.stdout
    assert "] 2 ranks, 4 B: ringsync time <= 1.5x MPI's:" in out.stdout, out.stdout
    assert "flight recorder and straggler events: a step of 20 x 4 KiB" in out.stdout, out.stdout


def test_bench_deterministic_compares_both_modes_per_case_and_size():
    out = subprocess.run([sys.executable, "-m", "ringsync.bench", "--deterministic", "--np", "2",
                          "--max-size", "4K", "--seconds", "0.05"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RINGSYNC_DETERMINISTIC=1 against the default" in out.stdout, out.stdout
    for case in ("allreduce (one host's paths)", "allreduce (engine: as across hosts)",
                 "reducescatter"):
        assert f"{case} |     4 KiB |" in out.stdout, out.stdout
