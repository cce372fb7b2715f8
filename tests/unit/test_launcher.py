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
    return dry_run_and_messages(capsys, *argv)[0]


def dry_run_and_messages(capsys, *argv):
    """(dry_run's command, what the launcher printed on stderr)."""
    assert launcher.main(["run", "--dry-run", *argv]) == 0
    printed = capsys.readouterr()
    return shlex.split(printed.out), printed.err


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


# ---------------------------------------------------------------- horovodrun's options

def settings_given(command) -> dict:
    """{NAME: value} of the `-x NAME=value` pairs in an mpirun command."""
    return dict(command[i + 1].split("=", 1) for i, word in enumerate(command)
                if word == "-x" and "=" in command[i + 1])


@pytest.mark.parametrize("argv, expected", [
    (["--fusion-threshold-mb", "32"], {"RINGSYNC_FUSION_THRESHOLD": str(32 * 1024 * 1024)}),
    (["--fusion-threshold-mb", "0"], {"RINGSYNC_FUSION_THRESHOLD": "0"}),
    (["--cycle-time-ms", "2.5"], {"RINGSYNC_CYCLE_TIME_MS": "2.5"}),
    (["--cache-capacity", "2048"], {"RINGSYNC_CACHE_CAPACITY": "2048"}),
    (["--hierarchical-allreduce"], {"RINGSYNC_HIERARCHICAL_ALLREDUCE": "on"}),
    (["--no-hierarchical-allreduce"], {"RINGSYNC_HIERARCHICAL_ALLREDUCE": "off"}),
    (["--timeline-filename", "t.json", "--timeline-mark-cycles"],
     {"RINGSYNC_TIMELINE": "t.json", "RINGSYNC_TIMELINE_MARK_CYCLES": "1"}),
    (["--stall-check-warning-time-seconds", "120"], {"RINGSYNC_STALL_CHECK_SECONDS": "120"}),
    (["--stall-check-warning-time-seconds", "120", "--no-stall-check"],
     {"RINGSYNC_STALL_CHECK_SECONDS": "0"}),  # disabling wins, as in Horovod
    (["--stall-check-shutdown-time-seconds", "240"], {"RINGSYNC_TIMEOUT_SECONDS": "240"}),
    (["--network-interfaces", "ib0,eth0", "--network-interface", "eth0",
      "--network-interface", "lo"], {"RINGSYNC_IFACE": "ib0,eth0,lo"}),
    (["--log-level", "DEBUG"], {"RINGSYNC_LOG_LEVEL": "debug"}),
    (["--start-timeout", "45"], {"RINGSYNC_START_TIMEOUT_SECONDS": "45"}),
    (["--autotune", "--autotune-log-file", "tune.csv", "--autotune-warmup-samples", "5",
      "--autotune-steps-per-sample", "20", "--autotune-bayes-opt-max-samples", "30"],
     {"RINGSYNC_AUTOTUNE": "1", "RINGSYNC_AUTOTUNE_LOG": "tune.csv",
      "RINGSYNC_AUTOTUNE_WARMUP_SAMPLES": "5", "RINGSYNC_AUTOTUNE_STEPS_PER_SAMPLE": "20",
      "RINGSYNC_AUTOTUNE_MAX_SAMPLES": "30"}),
    (["--elastic", "-H", "a:2,b:2", "--host-discovery-script", "d.sh", "--slots-per-host", "4"],
     {"RINGSYNC_ELASTIC_SLOTS_PER_HOST": "4"}),
])
def test_horovodrun_options_become_settings(fake_mpi, capsys, argv, expected):
    given = settings_given(dry_run(capsys, "-np", "2", *argv, "a.py"))
    for name, value in expected.items():
        assert given.get(name) == value, (argv, given)


def test_an_option_replaces_the_variable_it_sets(fake_mpi, capsys, monkeypatch):
    monkeypatch.setenv("RINGSYNC_CYCLE_TIME_MS", "9")
    command = dry_run(capsys, "-np", "2", "--cycle-time-ms", "3", "a.py")
    assert "RINGSYNC_CYCLE_TIME_MS" not in command  # not also the launcher's value
    assert settings_given(command)["RINGSYNC_CYCLE_TIME_MS"] == "3"


@pytest.mark.parametrize("argv, message", [
    (["--fusion-threshold-mb", "-1"], "argument --fusion-threshold-mb: '-1' must be zero or more"),
    (["--cycle-time-ms", "soon"], "argument --cycle-time-ms: 'soon' is not a number"),
    (["--cache-capacity", "1.5"], "argument --cache-capacity: '1.5' is not a whole number"),
    (["--start-timeout", "0"], "argument --start-timeout: '0' must be positive"),
    (["--log-level", "LOUD"], "argument --log-level: 'LOUD' is not one of TRACE, DEBUG"),
    (["-p", "x"], "argument -p/--ssh-port: 'x' is not a whole number"),
    (["--jsrun"], "--jsrun: ringsync run starts ranks with mpirun only"),
])
def test_bad_option_values_name_the_option(fake_mpi, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["run", "-np", "2", *argv, "a.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_options_without_meaning_here_are_reported_as_ignored(fake_mpi, capsys):
    command, err = dry_run_and_messages(
        capsys, "-np", "2", "--autotune-gaussian-process-noise", "0.5",
        "--num-nccl-streams", "2", "--thread-affinity", "1", "--gloo-timeout-seconds", "60",
        "--disable-cache", "--blacklist-cooldown-range", "10", "100", "a.py")
    assert command[-2:] == [sys.executable, "a.py"]  # every value was the option's
    for flag in ("--autotune-gaussian-process-noise", "--num-nccl-streams",
                 "--thread-affinity", "--gloo-timeout-seconds", "--disable-cache",
                 "--blacklist-cooldown-range"):
        assert f"ringsync run: ignored: {flag} (" in err, flag
    # Accepted controllers change nothing.
    assert dry_run(capsys, "-np", "2", "--gloo", "--tcp", "a.py") == dry_run(
        capsys, "-np", "2", "a.py")


def test_ssh_port_and_identity_reach_the_ssh_launcher(fake_mpi, capsys, monkeypatch):
    command = dry_run(capsys, "-np", "2", "-H", "a,b", "-p", "2222", "-i", "/k/id rsa", "a.py")
    at = command.index("--prtemca")  # Open MPI 5 (PRRTE)
    assert command[at + 1:at + 3] == ["plm_ssh_args", "-p 2222 -i '/k/id rsa'"]
    monkeypatch.setattr(launcher, "open_mpi_major", lambda mpirun: 4)
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


def test_check_build_prints_doctor_and_exits(fake_mpi, monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "doctor", lambda: calls.append("doctor") or 0)
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["run", "--check-build"])  # no -np needed, as horovodrun's
    assert exit_info.value.code == 0 and calls == ["doctor"]


HOROVOD_CONFIG = """\
# horovodrun --config-file
controller: gloo
params:
  fusion_threshold_mb: 32      # MB
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: true
autotune:
  enabled: true
  log_file: tune.csv
  warmup_samples: 2
  gaussian_process_noise: 0.5
timeline:
  filename: 'horovod # timeline.json'
  mark_cycles: yes
stall_check:
  enabled: false
  warning_time_seconds: 120
  shutdown_time_seconds: 240
logging:
  level: INFO
"""


def test_config_file_sets_what_the_command_line_does_not(fake_mpi, capsys, tmp_path):
    config = tmp_path / "hvd.yaml"
    config.write_text(HOROVOD_CONFIG)
    command, err = dry_run_and_messages(capsys, "-np", "2", "--config-file", str(config),
                                        "--cycle-time-ms", "3", "a.py")
    given = settings_given(command)
    assert given == {"RINGSYNC_FUSION_THRESHOLD": str(32 << 20),
                     "RINGSYNC_CYCLE_TIME_MS": "3",  # the command line wins
                     "RINGSYNC_CACHE_CAPACITY": "2048",
                     "RINGSYNC_HIERARCHICAL_ALLREDUCE": "on",
                     "RINGSYNC_TIMELINE": "horovod # timeline.json",
                     "RINGSYNC_TIMELINE_MARK_CYCLES": "1",
                     "RINGSYNC_STALL_CHECK_SECONDS": "0",  # stall_check.enabled: false
                     "RINGSYNC_TIMEOUT_SECONDS": "240",
                     "RINGSYNC_LOG_LEVEL": "info",
                     "RINGSYNC_AUTOTUNE": "1", "RINGSYNC_AUTOTUNE_LOG": "tune.csv",
                     "RINGSYNC_AUTOTUNE_WARMUP_SAMPLES": "2"}
    assert "ignored: params.hierarchical_allgather in" in err
    assert "ignored: autotune.gaussian_process_noise in" in err


@pytest.mark.parametrize("text, message", [
    ("params:\n  cycle_time_ms: -1\n", "params.cycle_time_ms: '-1' must be zero or more"),
    ("timeline:\n  mark_cycles: 2\n", "timeline.mark_cycles: 2 is not true or false"),
    ("controller: jsrun\n", "controller: 'jsrun' is not mpi or gloo"),
    ("params:\n  - cycle_time_ms\n", "line 2: expected 'key: value'"),
    ("params:\n  nested:\n    x: 1\n", "line 2: 'nested': nested sections are not supported"),
    ("params:\n  cycle_time_ms: [1, 2]\n", "line 2: '[1, 2]': only plain values"),
])
def test_bad_config_files_are_usage_errors(fake_mpi, capsys, tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["run", "-np", "2", "--config-file", str(config), "a.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_yaml_subset():
    assert launcher.parse_config_yaml(
        "a: 'it''s'\nb: \"x\\ty\"\nc: ~\nd: 1e3\ne: -4\nf: Off\ng: plain text # note\n"
        "s:\n\n  k: v#not-a-comment\n") == {
        "a": "it's", "b": "x\ty", "c": None, "d": 1000.0, "e": -4, "f": False,
        "g": "plain text", "s": {"k": "v#not-a-comment"}}


def test_output_files_split_the_tagged_lines_by_rank(tmp_path):
    import io
    files = launcher.OutputFiles(str(tmp_path / "out"), np=12)
    console = io.BytesIO()
    mpirun_output = (b"[1,0]<stdout>: zero\n[1,11]<stdout>: eleven\nmpirun says\n"
                     b"[Tue Dec  1 16:01:53 2026][1,0]<stdout>: stamped\n")
    files.pump(io.BytesIO(mpirun_output), console)
    files.close()
    assert console.getvalue() == mpirun_output  # the console sees everything
    assert (tmp_path / "out/rank.00/stdout").read_bytes() == b"zero\nstamped\n"
    assert (tmp_path / "out/rank.11/stdout").read_bytes() == b"eleven\n"


# --------------------------------------------------------------------------- the job's status


def record(kind, rank, at, cause=None, pid=None, spawned=False):
    """A record as ringsync.bootstrap.record_job_event writes it (time in ns)."""
    return {"kind": kind, "pid": pid or 1000 + rank, "host": "h", "rank": rank,
            "spawned": spawned, "time_ns": at, "code": 1 if kind == "failed" else None,
            "cause": cause}


def test_without_records_mpiruns_status_stands_alone():
    assert launcher.job_status(0, []) == (0, None)
    assert launcher.job_status(3, []) == (3, None)  # not a ringsync program


def test_failed_ranks_fail_a_job_mpirun_called_a_success_naming_the_first_failure_first():
    records = [record("started", r, 1) for r in (0, 1)]
    records += [record("failed", 1, 5, "RuntimeError: boom"),
                record("failed", 0, 7, "CommunicationError: rank 1 lost")]
    status, message = launcher.job_status(0, records)
    assert status == 1
    assert message.startswith("ringsync run: the job failed: rank 1 failed (RuntimeError: "
                              "boom); rank 0 failed (CommunicationError: rank 1 lost)"), message


def test_a_rank_finishing_after_the_failures_is_a_finished_job():
    records = [record("started", r, 1) for r in (0, 1, 2)]
    records += [record("failed", 2, 5, "RuntimeError: boom"), record("finished", 0, 9),
                record("finished", 1, 9)]
    assert launcher.job_status(0, records) == (0, None)
    # A rank that finished before the failure did not see the job through.
    records[-2:] = [record("finished", 0, 4)]
    assert launcher.job_status(0, records)[0] == 1


def test_ranks_that_left_no_end_were_killed():
    records = [record("started", r, 1) for r in (0, 1)]
    status, message = launcher.job_status(0, records)
    assert status == 1
    assert "rank 0 ended without a record" in message and "rank 1 ended without a record" in message
    # ... unless another rank finished after them (elastic survivors of a SIGKILL)
    assert launcher.job_status(0, records + [record("finished", 0, 9)]) == (0, None)


def test_a_rank_leaving_a_resized_job_is_no_failure():
    records = [record("started", 0, 1), record("left", 0, 3), record("started", 1, 1),
               record("finished", 1, 5)]
    assert launcher.job_status(0, records) == (0, None)


def test_a_start_after_an_end_counts_from_the_start():
    records = [record("started", 0, 1), record("finished", 0, 2), record("started", 0, 3)]
    assert "rank 0 ended without a record" in launcher.job_status(0, records)[1]


def test_mpiruns_failure_wins_and_the_failed_ranks_are_named():
    records = [record("started", 0, 1), record("failed", 0, 2, "ValueError: x" * 50),
               record("started", 0, 1, pid=77, spawned=True)]
    status, message = launcher.job_status(137, records)
    assert status == 137
    assert message.startswith("ringsync run: the job failed (exit status 137): rank 0 failed "
                              "(ValueError: x"), message
    assert "...); a replacement rank (pid 77) ended without a record" in message
    assert launcher.job_status(3, [record("started", 0, 1), record("finished", 0, 2)]) == \
        (3, "ringsync run: the job failed (exit status 3)")


def test_ranks_record_how_they_end_where_the_launcher_reads_it(tmp_path):
    from ringsync import bootstrap
    env = {bootstrap.JOB_STATUS_DIR_ENV: str(tmp_path), "OMPI_COMM_WORLD_RANK": "3"}
    bootstrap.record_job_event("started", environ=env)
    bootstrap.record_job_event("failed", code=1, cause="E" * 1000, environ=env)
    (tmp_path / ".half-written.json").write_text("{")
    records = launcher.read_job_records(str(tmp_path))
    assert [(r["kind"], r["rank"], r["pid"]) for r in records] == \
        [("failed", 3, os.getpid()), ("started", 3, os.getpid())]
    assert len(records[0]["cause"]) == bootstrap.CAUSE_LIMIT
    bootstrap.record_job_event("finished", environ={bootstrap.JOB_STATUS_DIR_ENV:
                                                    str(tmp_path / "not-on-this-host")})
    assert not (tmp_path / "not-on-this-host").exists()


def test_the_ranks_get_the_status_directory(fake_mpi):
    options = launcher.parse_run_options(["-np", "2", "--elastic", "train.py"])
    command = launcher.build_mpirun_command(options, job_status_dir="/tmp/ringsync-job-x")
    assert "RINGSYNC_JOB_STATUS_DIR=/tmp/ringsync-job-x" in command
    assert not any("RINGSYNC_JOB_STATUS_DIR" in word
                   for word in launcher.build_mpirun_command(options))
