"""Which world init() would join (ringsync.rendezvous_env.find_world), from the variables
each launcher sets: nothing is connected here. Jobs that do connect:
tests/mpi/test_launchers.py, tests/hosts/test_pods.py."""
import pytest

from ringsync.errors import UsageError
from ringsync.launch import doctor
from ringsync.rendezvous_env import (SLURM_PORT_BASE, SLURM_PORT_SPAN, find_world,
                                     first_host)

SECRET = "0123456789abcdef0123"
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job9",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0",
         "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu3", "SLURM_JOB_NODELIST": "gpu[01-20]"}


def test_mpirun_wins_over_every_other_launchers_variables():
    world = find_world(dict(TORCHRUN, **SLURM, OMPI_COMM_WORLD_RANK="3"))
    assert world.kind == "mpi" and "OMPI_COMM_WORLD_RANK" in world.why


def test_torchrun_without_a_secret_uses_torchruns_agent_store():
    world = find_world(TORCHRUN)
    assert (world.kind, world.rank, world.size, world.store, world.serve, world.torch_store) \
        == ("env", 1, 4, "tcp://node7:29500", False, True)
    assert world.prefix == "ringsync/job9.2"  # a restarted job meets anew


def test_env_variables_with_a_secret_meet_at_rank_0s_store_beside_torchs():
    pod = {k: v for k, v in TORCHRUN.items() if not k.startswith("TORCHELASTIC")}
    world = find_world(dict(pod, RINGSYNC_SECRET=SECRET))
    assert (world.store, world.serve, world.torch_store) == ("tcp://node7:29501", False, False)
    rank0 = find_world(dict(pod, RANK="0", RINGSYNC_SECRET=SECRET, RINGSYNC_STORE_PORT="4000"))
    assert (rank0.store, rank0.serve) == ("tcp://node7:4000", True)


def test_slurm_task_meets_on_the_steps_first_node_at_a_port_from_the_job_id():
    world = find_world(SLURM)
    port = SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN
    assert (world.kind, world.rank, world.size, world.store, world.serve) == \
        ("slurm", 5, 8, f"tcp://gpu07:{port}", False)
    assert "SLURM_PROCID" in world.describe()
    # sbatch's own shell (no step yet) is not a task: it stays a world of its own
    assert find_world({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}).kind != "slurm"


@pytest.mark.parametrize("text,host", [("gpu[07-09,12],cpu3", "gpu07"), ("a,b", "a"),
                                       ("rack[1-2]-n[3-4]", "rack1-n3"), ("x[010]", "x010"),
                                       ("solo", "solo")])
def test_first_host_of_a_slurm_host_list(text, host):
    assert first_host(text) == host


def test_a_rendezvous_named_outright():
    assert find_world({"RINGSYNC_RENDEZVOUS": "mpi", **TORCHRUN}).kind == "mpi"
    tcp = find_world({"RANK": "2", "WORLD_SIZE": "3"}, rendezvous="tcp://10.0.0.1:7000")
    assert (tcp.kind, tcp.rank, tcp.size, tcp.store, tcp.serve) == \
        ("tcp", 2, 3, "tcp://10.0.0.1:7000", False)
    shared = find_world({**SLURM, "RINGSYNC_RENDEZVOUS": "file:///shared/job"})
    assert (shared.kind, shared.rank, shared.size) == ("file", 5, 8)
    joining = find_world({"RINGSYNC_ELASTIC_JOIN": "1",
                          "RINGSYNC_RENDEZVOUS": "tcp://127.0.0.1:5"})
    assert joining.join and "replacement" in joining.describe()


@pytest.mark.parametrize("environ,words", [
    ({"RINGSYNC_RENDEZVOUS": "env://", "RANK": "0"}, "WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
    ({"RINGSYNC_RENDEZVOUS": "ftp://x"}, "none of 'mpi'"),
    ({"RINGSYNC_RENDEZVOUS": "file://relative/dir", "RANK": "0", "WORLD_SIZE": "1"},
     "absolute path"),
    ({"RINGSYNC_RENDEZVOUS": "tcp://hostonly", "RANK": "0", "WORLD_SIZE": "1"},
     "tcp://HOST:PORT"),
    ({"RINGSYNC_RENDEZVOUS": "tcp://h:99999", "RANK": "0", "WORLD_SIZE": "1"},
     "not a TCP port"),
    ({"RINGSYNC_RENDEZVOUS": "tcp://h:5"}, "place is not known"),
    (dict(TORCHRUN, RANK="4"), "RANK=4 is out of range for WORLD_SIZE=4"),
    (dict(TORCHRUN, MASTER_PORT="http"), "MASTER_PORT='http' is not a number"),
    (dict(SLURM, SLURM_JOB_ID="x1"), "SLURM_JOB_ID 'x1'"),
])
def test_bad_variables_are_named(environ, words):
    with pytest.raises(UsageError, match=None) as caught:
        find_world(environ)
    assert words in str(caught.value)


def test_doctor_never_shows_the_secret(monkeypatch):
    monkeypatch.setenv("RINGSYNC_SECRET", SECRET)
    report = "\n".join(doctor.settings_report())
    assert SECRET not in report and "RINGSYNC_SECRET=(set; never shown)" in report


def test_doctor_says_which_world_and_why(monkeypatch):
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RINGSYNC_RENDEZVOUS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    text = doctor.world_description()
    assert "rank 1 of 4" in text and "torchrun's store" in text and "set by torchrun" in text
    monkeypatch.setenv("RINGSYNC_RENDEZVOUS", "gopher://x")
    assert "none of 'mpi'" in doctor.guarded(doctor.world_description)


def test_a_bad_unrelated_setting_does_not_hide_the_world():
    """(init() reports it through the ring's first exchange, on every rank)"""
    assert find_world(dict(TORCHRUN, RINGSYNC_FUSION_THRESHOLD="lots")).kind == "env"
