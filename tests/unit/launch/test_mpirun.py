"""ringsync.launch.mpirun: the mpirun command line `ringsync run` builds (with a pretend
MPI): extra mpirun options, exports, elastic options, ssh, output tags and placement."""

import os
import sys

import pytest

from ringsync.launch import cli
from ringsync.launch import mpirun as mpirun_module

from .helpers import dry_run, program_part, rank_program


def test_mpi_args_and_discovery_options(fake_mpi, capsys, tmp_path):
    command = dry_run(capsys, "-np", "2", "--mpi-args=--prtemca plm_ssh_agent '/a b/agent'",
                      "a.py")
    assert program_part(command, "--prtemca")[:4] == [
        "--prtemca", "plm_ssh_agent", "/a b/agent", sys.executable]
    assert rank_program(command) == [sys.executable, "a.py"]
    script = tmp_path / "discover.sh"
    command = dry_run(capsys, "-np", "2", "-H", "a:2,b:2", "--elastic",
                      "--host-discovery-script", str(script), "a.py")
    assert f"RINGSYNC_ELASTIC_DISCOVERY_SCRIPT={script}" in command
    with pytest.raises(SystemExit):
        cli.parse_run_options(["-np", "2", "--host-discovery-script", str(script), "a.py"])
    assert "only with --elastic" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_run_options(["-np", "2", "--elastic", "--host-discovery-script",
                                    str(script), "a.py"])
    assert "-H or --hostfile" in capsys.readouterr().err


def test_root_gets_allow_run_as_root(fake_mpi, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "--allow-run-as-root" in dry_run(capsys, "-np", "2", "a.py")


def test_ringsync_settings_are_exported_to_ranks(fake_mpi, capsys, monkeypatch):
    monkeypatch.setenv("RINGSYNC_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    words = " ".join(dry_run(capsys, "-np", "2", "a.py"))
    assert "-x RINGSYNC_FUSION_THRESHOLD" in words
    assert "-x PATH" in words and "-x PYTHONPATH" in words


def test_elastic_asks_for_ulfm(fake_mpi, capsys):
    command = dry_run(capsys, "-np", "2", "--elastic", "a.py")
    assert command[command.index("--with-ft") + 1] == "ulfm"
    assert "--with-ft" not in dry_run(capsys, "-np", "2", "a.py")


def test_elastic_options_reach_the_ranks(fake_mpi, capsys):
    words = " ".join(dry_run(capsys, "-np", "4", "--elastic", "--min-np", "2", "--max-np", "6",
                             "--respawn", "--reset-limit", "3", "a.py"))
    for setting in ("RINGSYNC_ELASTIC_MIN_NP=2", "RINGSYNC_ELASTIC_MAX_NP=6",
                    "RINGSYNC_ELASTIC_RESPAWN=1", "RINGSYNC_ELASTIC_RESET_LIMIT=3"):
        assert f"-x {setting}" in words


def test_ssh_port_and_identity_reach_the_ssh_launcher(fake_mpi, capsys, monkeypatch):
    command = dry_run(capsys, "-np", "2", "-H", "a,b", "-p", "2222", "-i", "/k/id rsa", "a.py")
    at = command.index("--prtemca")  # Open MPI 5 (PRRTE)
    assert command[at + 1:at + 3] == ["plm_ssh_args", "-p 2222 -i '/k/id rsa'"]
    monkeypatch.setattr(mpirun_module, "open_mpi_major", lambda mpirun: 4)
    command = dry_run(capsys, "-np", "2", "-H", "a,b", "--ssh-port", "2222", "a.py")
    assert command[command.index("--mca") + 1:][:2] == ["plm_rsh_args", "-p 2222"]
    assert "--prtemca" not in dry_run(capsys, "-np", "2", "a.py")


def test_output_is_tagged_and_placed_as_horovodrun(fake_mpi, capsys):
    command = dry_run(capsys, "-np", "2", "a.py")
    assert "--tag-output" in command and "--timestamp-output" not in command
    assert command[command.index("--bind-to") + 1] == "none"
    assert command[command.index("--map-by") + 1] == "slot"
    assert "--timestamp-output" in dry_run(capsys, "-np", "2", "--prefix-output-with-timestamp",
                                           "a.py")
    # The user's own placement wins.
    command = dry_run(capsys, "-np", "2", "--binding-args=--bind-to core --map-by socket",
                      "a.py")
    assert command.count("--bind-to") == 1 and command.count("--map-by") == 1
    assert command[command.index("--bind-to") + 1] == "core"
    command = dry_run(capsys, "-np", "2", "--mpi-args=-bind-to socket", "a.py")
    assert "--bind-to" not in command and command[command.index("--map-by") + 1] == "slot"


def test_the_whole_environment_reaches_the_ranks(fake_mpi, capsys, monkeypatch):
    for name, value in {"MY_DATA_DIR": "/data", "HOROVOD_FUSION_THRESHOLD": "1024",
                        "OLDPWD": "/x", "BASH_FUNC_module%%": "() { :; }",
                        "OMPI_COMM_WORLD_RANK": "3", "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(name, value)
    command = dry_run(capsys, "-np", "2", "a.py")
    exported = {command[i + 1] for i, word in enumerate(command) if word == "-x"}
    assert {"MY_DATA_DIR", "HOROVOD_FUSION_THRESHOLD", "PATH", "HOME"} <= exported
    for name in ("OLDPWD", "BASH_FUNC_module%%", "OMPI_COMM_WORLD_RANK", "CUDA_VISIBLE_DEVICES"):
        assert name not in exported, name


def test_the_ranks_get_the_status_directory(fake_mpi):
    options = cli.parse_run_options(["-np", "2", "--elastic", "train.py"])
    command = mpirun_module.build_mpirun_command(options, job_status_dir="/tmp/ringsync-job-x")
    assert "RINGSYNC_JOB_STATUS_DIR=/tmp/ringsync-job-x" in command
    assert not any("RINGSYNC_JOB_STATUS_DIR" in word
                   for word in mpirun_module.build_mpirun_command(options))


def test_each_rank_starts_through_rank_env(fake_mpi, capsys, monkeypatch, tmp_path):
    """ringsync.launch.rank_env gives the ranks torch's env:// variables: MASTER_ADDR is
    the first host (of -H, else of the hostfile, else this one), MASTER_PORT the launcher's
    choice, and a MASTER_* the launcher's environment sets is left to it."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def wrapper_options(*argv):
        command = dry_run(capsys, *argv, "a.py")
        at = command.index("ringsync.launch.rank_env")
        return command[at + 1:command.index("--", at)]

    port = str(mpirun_module.free_port())
    assert wrapper_options("-np", "2") == ["--master-addr=127.0.0.1", f"--master-port={port}"]
    assert wrapper_options("-np", "2", "-H", "n1:2,n2:2")[0] == "--master-addr=n1"
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2 slots=2\n")
    assert wrapper_options("-np", "2", "--hostfile", str(hostfile))[0] == "--master-addr=node1"
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert wrapper_options("-np", "2") == ["--master-addr=127.0.0.1"]
    monkeypatch.setattr(mpirun_module, "mpi_flavor", lambda mpirun: mpirun_module.UNKNOWN)
    assert dry_run(capsys, "-np", "2", "a.py")[-2:] == [sys.executable, "a.py"]
    assert "ringsync.launch.rank_env" not in dry_run(capsys, "-np", "2", "a.py")
