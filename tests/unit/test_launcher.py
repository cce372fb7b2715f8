"""The ringsync command, in one process: mpirun command building (with a pretend MPI),
signals passed on to a stand-in for mpirun, doctor without the native core.

Tests that start real jobs through the command are in tests/mpi/test_launcher.py;
signals to a running job's launcher in tests/faults/test_launcher_signals.py."""

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from ringsync import launcher

FAKE_MPIRUN = "/opt/mpi/bin/mpirun"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(launcher.__file__)))


@pytest.fixture
def fake_mpi(monkeypatch):
    """A pretend Open MPI on a 4-core host, run by a normal user, with no RINGSYNC_* set."""
    monkeypatch.setattr(launcher, "find_mpirun", lambda: FAKE_MPIRUN)
    monkeypatch.setattr(launcher, "mpi_flavor", lambda mpirun: launcher.OPEN_MPI)
    monkeypatch.setattr(launcher, "local_slots", lambda: 4)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for name in list(os.environ):
        if name.startswith("RINGSYNC_"):
            monkeypatch.delenv(name)


def dry_run(capsys, *argv):
    """The mpirun command `ringsync run --dry-run ...` prints, as a list."""
    assert launcher.main(["run", "--dry-run", *argv]) == 0
    return shlex.split(capsys.readouterr().out)


def program_part(command, first_word):
    return command[command.index(first_word):]


def test_np_and_program_arguments_pass_through_untouched(fake_mpi, capsys):
    command = dry_run(capsys, "-np", "2", "train.py", "-np", "3", "--verbose", "--", "x")
    assert command[:3] == [FAKE_MPIRUN, "-np", "2"]
    assert program_part(command, sys.executable) == [
        sys.executable, "train.py", "-np", "3", "--verbose", "--", "x"]
    assert "--oversubscribe" not in command
    assert "--allow-run-as-root" not in command


def test_double_dash_starts_the_program(fake_mpi, capsys):
    command = dry_run(capsys, "-np", "2", "--", "python", "-c", "print(1)")
    assert command[-3:] == ["python", "-c", "print(1)"]  # not a .py file: no interpreter added


def test_oversubscribe_when_np_exceeds_local_cores(fake_mpi, capsys):
    assert "--oversubscribe" not in dry_run(capsys, "-np", "4", "a.py")
    assert "--oversubscribe" in dry_run(capsys, "-np", "5", "a.py")


def oversubscribes_by_slot(command) -> bool:
    """With hosts, oversubscription maps by slot (plain --oversubscribe would put every
    rank on the first host)."""
    return ("--oversubscribe" not in command and "--map-by" in command
            and command[command.index("--map-by") + 1] == "slot:oversubscribe")


def test_oversubscribe_counts_slots_of_listed_hosts(fake_mpi, capsys):
    command = dry_run(capsys, "-np", "4", "-H", "a:2,b:2", "a.py")
    assert "--oversubscribe" not in command and not oversubscribes_by_slot(command)
    assert command[command.index("--map-by") + 1] == "slot"  # horovodrun's placement
    assert command[command.index("-H") + 1] == "a:2,b:2"
    assert oversubscribes_by_slot(dry_run(capsys, "-np", "5", "-H", "a:2,b:2", "a.py"))
    assert oversubscribes_by_slot(dry_run(capsys, "-np", "3", "-H", "a,b", "a.py"))  # 1 slot each
    # The user's own mapping wins.
    command = dry_run(capsys, "-np", "5", "-H", "a:2,b:2", "--mpi-args=--map-by node", "a.py")
    assert "slot:oversubscribe" not in command and command.count("--map-by") == 1
    assert command[-4:] == ["--map-by", "node", sys.executable, "a.py"]


def test_mpi_args_and_discovery_options(fake_mpi, capsys, tmp_path):
    command = dry_run(capsys, "-np", "2", "--mpi-args=--prtemca plm_ssh_agent '/a b/agent'",
                      "a.py")
    assert command[-5:] == ["--prtemca", "plm_ssh_agent", "/a b/agent", sys.executable, "a.py"]
    script = tmp_path / "discover.sh"
    command = dry_run(capsys, "-np", "2", "-H", "a:2,b:2", "--elastic",
                      "--host-discovery-script", str(script), "a.py")
    assert f"RINGSYNC_ELASTIC_DISCOVERY_SCRIPT={script}" in command
    with pytest.raises(SystemExit):
        launcher.parse_run_options(["-np", "2", "--host-discovery-script", str(script), "a.py"])
    assert "only with --elastic" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.parse_run_options(["-np", "2", "--elastic", "--host-discovery-script",
                                    str(script), "a.py"])
    assert "-H or --hostfile" in capsys.readouterr().err


def test_hostfile_passes_through_and_its_slots_count(fake_mpi, capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2 slots=1  # small one\n\n")
    command = dry_run(capsys, "-np", "3", "--hostfile", str(hostfile), "a.py")
    assert command[command.index("--hostfile") + 1] == str(hostfile)
    assert "--oversubscribe" not in command
    assert oversubscribes_by_slot(dry_run(capsys, "-np", "4", "--hostfile", str(hostfile), "a.py"))


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


@pytest.mark.parametrize("argv,message", [
    (["-np", "4", "--min-np", "2"], "--min-np: only with --elastic"),
    (["-np", "4", "--elastic", "--min-np", "5"], "--min-np 5 must be between 1 and -np 4"),
    (["-np", "4", "--elastic", "--max-np", "3"], "--max-np 3 is below -np 4"),
    (["-np", "4", "--elastic", "--reset-limit", "-1"], "--reset-limit -1 must be 0"),
])
def test_bad_elastic_options_are_usage_errors(fake_mpi, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["run"] + argv + ["a.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_program_or_np_is_a_usage_error(fake_mpi, capsys):
    for argv in (["run", "-np", "2"], ["run", "a.py"], ["run", "-np", "0", "a.py"]):
        with pytest.raises(SystemExit) as exit_info:
            launcher.main(argv)
        assert exit_info.value.code == 2


def test_no_mpirun_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "find_mpi_tool", lambda name: None)
    assert launcher.main(["run", "-np", "2", "--dry-run", "a.py"]) == 1
    assert "no mpirun found" in capsys.readouterr().err


def test_verbose_prints_command_and_settings(fake_mpi, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr(launcher, "run_forwarding_signals",
                        lambda cmd, output=None: launched.append(cmd) or 0)
    monkeypatch.setenv("RINGSYNC_TIMEOUT_SECONDS", "30")
    assert launcher.main(["run", "-np", "2", "--verbose", "a.py"]) == 0
    err = capsys.readouterr().err
    assert "command: " + shlex.join(launched[0]) in err
    assert "RINGSYNC_TIMEOUT_SECONDS=30" in err


# Stands in for mpirun: exits with the number of the signal it gets, once it has said
# (by creating the file named by its argument) that its handlers are in place.
REPORTS_ITS_SIGNAL = (
    "import pathlib, signal, sys, time\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1):\n"
    "    signal.signal(s, lambda n, f: sys.exit(n))\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "time.sleep(30)\n"
)


@pytest.mark.parametrize("sent, received", [
    (signal.SIGINT, signal.SIGINT),
    (signal.SIGQUIT, signal.SIGTERM),  # mpirun would die of SIGQUIT and leave its ranks
    (signal.SIGUSR1, signal.SIGUSR1),
], ids=["SIGINT", "SIGQUIT", "SIGUSR1"])
def test_signals_reach_mpirun_as_signals_it_handles(tmp_path, sent, received):
    ready = tmp_path / "ready"

    def signal_launcher_once_child_is_ready():
        give_up = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < give_up:
            time.sleep(0.01)
        os.kill(os.getpid(), sent)  # this process plays the launcher

    # A no-op outside run_forwarding_signals: a late signal must not end pytest.
    previous = signal.signal(sent, lambda *_: None)
    sender = threading.Thread(target=signal_launcher_once_child_is_ready)
    sender.start()
    try:
        status = launcher.run_forwarding_signals(
            [sys.executable, "-c", REPORTS_ITS_SIGNAL, str(ready)])
    finally:
        sender.join(timeout=60)
        signal.signal(sent, previous)
    assert status == received


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux only")
def test_mpirun_gets_sigterm_when_the_launcher_dies():
    # PR_GET_PDEATHSIG (2): the signal the kernel will send when the launcher dies.
    code = ("import ctypes, sys; death = ctypes.c_int(); "
            "ctypes.CDLL(None).prctl(2, ctypes.byref(death)); sys.exit(death.value)")
    assert launcher.run_forwarding_signals([sys.executable, "-c", code]) == signal.SIGTERM


def test_doctor_works_without_the_native_core():
    # sys.modules[name] = None makes any import of ringsync._native fail, as if unbuilt.
    code = ("import sys; sys.modules['ringsync._native'] = None; "
            "from ringsync.launcher import main; sys.exit(main(['doctor']))")
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    finished = subprocess.run([sys.executable, "-c", code],
                              capture_output=True, text=True, env=env, timeout=120)
    assert finished.returncode == 0, finished.stderr
    native_line = [l for l in finished.stdout.splitlines() if l.startswith("native core:")]
    assert "not built" in native_line[0]
    assert "mpi4py" in finished.stdout
