"""torch.distributed on the "ringsync" backend (ringsync.torch.distributed): the collective
matrix of tests/mpi/torch_distributed_bodies.py under torchrun on 1-3 ranks (the ring built
over torch's store, no MPI), the same checks on gloo (so that they test torch's semantics),
and under mpirun (the world group on the job's MPI-built ring)."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from ringsync.testing import assert_mpi_ok
from tests.common.jobs import run_to_deadline

BODIES = "tests.mpi.torch_distributed_bodies"  # (named: pytest's process imports no torch)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 300


def torchrun(nproc: int, *args, program=("-m", BODIES), env=None):
    """`python -m torch.distributed.run --standalone` of the bodies module (or another
    program); returns (exit status, output), the job killed (its whole session) at the
    deadline."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *program, *args]
    environ = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   **(env or {}))
    return run_to_deadline(command, environ, DEADLINE_S, cwd=ROOT)


@pytest.mark.parametrize("backend,nproc", [("ringsync", 1), ("ringsync", 2), ("ringsync", 3),
                                           ("gloo", 2)])
def test_collective_matrix_under_torchrun(backend, nproc):
    status, output = torchrun(nproc, backend)
    assert status == 0, f"torchrun exit status {status}; every rank's output:\n{output}"
    for rank in range(nproc):  # every check ran to the end on every rank
        assert f"--- every check passed ({backend}, rank {rank})" in output, output


@pytest.mark.requires_mpirun
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_collective_matrix_under_mpirun(np_, tmp_path):
    assert_mpi_ok(f"{BODIES}:under_mpirun", np=np_, timeout=DEADLINE_S,
                  args=(str(tmp_path / "rendezvous"),), env={"OMP_NUM_THREADS": "1"})


def test_a_late_rank_is_a_dist_backend_error_within_the_timeout(tmp_path):
    """...and ringsync's stall report names it first, as for its own collectives."""
    status, output = torchrun(2, "ringsync", "late_rank_times_out", str(tmp_path / "left"),
                              env={"RINGSYNC_STALL_CHECK_SECONDS": "1"})
    assert status == 0, output
    assert "--- rank 0 raised DistBackendError after" in output, output
    assert "waited 4.0 s for ranks [1]" in output, output  # (the rank it waited for)
    assert re.search(r"ringsync: stall: tensor '[^']+' \(allreduce\) was submitted by "
                     r"ranks \[0\] but ranks \[1\] have not", output), output


def spawn_ranks(nproc: int, *args, env=None):
    """The bodies module on nproc processes that meet through env:// (a TCPStore on rank
    0), started here rather than by torchrun, which would kill the others once one dies;
    returns each rank's (exit status, output), every rank killed at the deadline."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jobs = []
    for rank in range(nproc):
        environ = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), **(env or {}))
        jobs.append(subprocess.Popen([sys.executable, "-m", BODIES, *args], cwd=ROOT,
                                     env=environ, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True))
    results, deadline = [], time.monotonic() + DEADLINE_S
    for job in jobs:
        try:
            output, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in jobs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            output, _ = job.communicate()
        results.append((job.returncode, output))
    return results


def test_a_dead_rank_fails_every_survivors_pending_work():
    results = spawn_ranks(3, "ringsync", "a_dead_rank_fails_every_pending_call")
    everything = "\n".join(f"=== rank {r} (exit {status}):\n{output}"
                            for r, (status, output) in enumerate(results))
    assert results[2][0] == -signal.SIGKILL, everything
    for rank in range(2):
        assert results[rank][0] == 0, everything
        for what in ("async", "blocking"):
            assert f"--- rank {rank} {what}: DistBackendError" in results[rank][1], everything


def test_a_script_that_never_destroys_its_group_exits_0():
    """Left to the interpreter's exit, a group's threads and ring were torn down under
    torch's, and about half such runs aborted ("terminate called without an active
    exception"): four runs, each of which must exit 0."""
    for attempt in range(4):
        status, output = torchrun(2, "ringsync", "exits_without_destroying_its_group")
        assert status == 0 and "terminate called" not in output, \
            f"run {attempt}: exit status {status}:\n{output}"


def test_different_collectives_fail_on_every_rank_naming_both():
    status, output = torchrun(3, "ringsync", "different_collectives_fail_naming_both")
    assert status == 0, output
    for rank in range(3):
        assert f"--- rank {rank} raised DistBackendError" in output, output
        assert f"--- rank {rank}: the next all_reduce works" in output, output


def test_one_ranks_bad_arguments_fail_the_call_on_every_rank_at_once():
    status, output = torchrun(2, "ringsync", "bad_arguments_fail_on_every_rank")
    assert status == 0, output
    for name in ("all_gather_into_tensor", "all_to_all_single", "scatter", "broadcast"):
        assert f"--- rank 1 {name}: ValueError" in output, output
        assert f"--- rank 0 {name}: DistBackendError" in output, output
        for rank in range(2):
            assert f"--- rank {rank} {name}: the next all_reduce works" in output, output


def test_the_ddp_example_learns_alike_on_ringsync_and_gloo():
    """examples/ddp_digits.py, unchanged but for --backend: on 2 ranks a sum has one
    order, so both backends train to the same accuracy. (gloo's exit status is not
    checked: on torch 2.13 a gloo rank sometimes aborts at exit, after training, with
    "terminate called without an active exception", also without ringsync imported.)"""
    accuracy = {}
    for backend in ("ringsync", "gloo"):
        status, output = torchrun(2, "--check", "--backend", backend,
                                  program=(os.path.join(ROOT, "examples", "ddp_digits.py"),))
        assert status == 0 or backend == "gloo", output
        found = re.search(r"test accuracy on 2 ranks: ([0-9.]+)", output)
        assert found, output
        accuracy[backend] = found.group(1)
    assert accuracy["ringsync"] == accuracy["gloo"], accuracy


@pytest.mark.parametrize("backend", ["ringsync", "gloo"])
def test_a_two_by_two_mesh(backend):
    """new_subgroups, a 2 x 2 DeviceMesh's groups, DTensor over it and HSDP training (one
    process's parameters) on 4 ranks."""
    status, output = torchrun(4, backend, "meshes")
    assert status == 0 or backend == "gloo", output  # (gloo's exit: see below)
    for rank in range(4):
        assert f"--- meshes done ({backend}, rank {rank})" in output, output


def test_user_code_ends_where_gloo_does():
    """DDP's hooks and join, ZeroRedundancyOptimizer, FSDP2's options and
    torch.distributed.checkpoint (check_user_code, which also checks each against one
    process where there is a reference) end with the very same parameters on ringsync
    as on gloo: on 2 ranks every sum has one order."""
    digests = {}
    for backend in ("ringsync", "gloo"):
        status, output = torchrun(2, backend, "user_code")
        assert status == 0 or backend == "gloo", output  # (gloo's exit: see below)
        for rank in range(2):
            assert f"--- user code done ({backend}, rank {rank})" in output, output
        digests[backend] = sorted(set(re.findall(r"--- digest ([^:]+): (\w+) \(rank", output)))
        assert len(digests[backend]) == 8, output  # (one per variant: alike on both ranks)
    assert digests["ringsync"] == digests["gloo"], digests


def test_tensors_off_the_cpu_go_to_the_groups_cuda_backend():
    """The routing of "cpu:ringsync,cuda:nccl" (checked on a GPU by hand: see the README):
    every collective whose tensors are not on the CPU goes to the group's NCCL backend,
    under NCCL's method names; CPU tensors, or no such backend, stay on ringsync."""
    torch = pytest.importorskip("torch")
    from ringsync.torch.distributed._devices import FORWARDED, forward_cuda_to_nccl

    class Accelerator:  # (records what reached it)
        def __getattr__(self, name):
            return lambda *args: ("nccl", name)

    def own(name):
        return lambda self, *args: ("ringsync", name)

    def init(self, cuda):
        self.cuda = cuda
    Group = forward_cuda_to_nccl(type("Group", (), {"__init__": init,
                                                    **{n: own(n) for n in FORWARDED}}))
    off_cpu, on_cpu = torch.empty(2, device="meta"), torch.empty(2)
    nccl_names = {"all_gather_single": "_allgather_base", "all_to_all_single": "alltoall_base",
                  "reduce_scatter_single": "_reduce_scatter_base"}
    for name in FORWARDED:
        want = nccl_names.get(name, name)
        assert getattr(Group(Accelerator()), name)([[off_cpu]], None) == ("nccl", want), name
        assert getattr(Group(Accelerator()), name)(on_cpu, None) == ("ringsync", name), name
        assert getattr(Group(None), name)([off_cpu], None) == ("ringsync", name), name
