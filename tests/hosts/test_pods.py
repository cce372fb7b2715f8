"""Ranks on several hosts without MPI (each host a network namespace of this machine:
ringsync.testing.VirtualHosts). As Kubernetes pods: each rank started on its own host with
nothing but the variables a PyTorchJob gives (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
and the job's secret; rank 0 serves the store. And through `ringsync run --launcher ssh`,
with the hosts' launch agent in ssh's place. The rank code is tests/common/launched_job.py."""
import shlex
import subprocess
import sys

from tests.common.jobs import run_to_deadline
from tests.mpi.test_launchers import (JOB, PARTS, ROOT, SECRET, check_places, finish_tasks,
                                      job_environment)

MASTER_PORT = 29400


def start_pod(hosts, host, variables, result_dir, parts):
    """One rank on host, as a pod: its command run inside the host by the launch agent,
    with only the given variables on top of a clean environment."""
    words = ["env"] + [f"{k}={v}" for k, v in variables.items()] + \
        [sys.executable, *JOB, result_dir, *parts]
    command = shlex.join(["cd", ROOT]) + " && exec " + shlex.join(words)
    return subprocess.Popen([hosts.agent, host, command], env=job_environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_pods_with_pytorchjob_variables_alone(virtual_hosts, tmp_path):
    hosts = virtual_hosts(2, rate=None)
    pods = [start_pod(hosts, host, {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                    "MASTER_ADDR": hosts.names[0],
                                    "MASTER_PORT": str(MASTER_PORT), "RINGSYNC_SECRET": SECRET},
                      str(tmp_path), PARTS)
            for rank, host in enumerate(hosts.names)]
    statuses, output = finish_tasks(pods)
    assert statuses == [0, 0], output
    check_places(str(tmp_path), 2, output, hosts=2)


def test_ringsync_run_over_ssh_through_the_hosts_agent(virtual_hosts, tmp_path):
    hosts = virtual_hosts(2, rate=None)
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "ssh",
               "--ssh-agent", hosts.agent, "--store-address", hosts.head_address,
               "-H", hosts.hosts_arg(2), "-np", "4", sys.executable, *JOB, str(tmp_path),
               "collectives"]
    status, output = run_to_deadline(command, job_environment(), 300, cwd=ROOT)
    assert status == 0, f"ringsync run exit status {status}:\n{output}"
    check_places(str(tmp_path), 4, output, parts=["collectives"], hosts=2)
    assert SECRET not in output and "RINGSYNC_SECRET=" not in output
