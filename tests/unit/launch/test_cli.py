"""ringsync.launch.cli: `ringsync run`'s arguments (the program's own untouched, usage
errors, horovodrun's options becoming settings or reported as ignored), --verbose,
--check-build."""

import shlex
import sys

import pytest

from ringsync.launch import cli, doctor, process
from ringsync.launch import mpirun as mpirun_module

from .helpers import FAKE_MPIRUN, dry_run, dry_run_and_messages, rank_program, settings_given


def test_np_and_program_arguments_pass_through_untouched(fake_mpi, capsys):
    command = dry_run(capsys, "-np", "2", "train.py", "-np", "3", "--verbose", "--", "x")
    assert command[:3] == [FAKE_MPIRUN, "-np", "2"]
    assert rank_program(command) == [
        sys.executable, "train.py", "-np", "3", "--verbose", "--", "x"]
    assert "--oversubscribe" not in command
    assert "--allow-run-as-root" not in command


def test_double_dash_starts_the_program(fake_mpi, capsys):
    command = dry_run(capsys, "-np", "2", "--", "python", "-c", "print(1)")
    assert command[-3:] == ["python", "-c", "print(1)"]  # not a .py file: no interpreter added


@pytest.mark.parametrize("argv,message", [
    (["-np", "4", "--min-np", "2"], "--min-np: only with --elastic"),
    (["-np", "4", "--elastic", "--min-np", "5"], "--min-np 5 must be between 1 and -np 4"),
    (["-np", "4", "--elastic", "--max-np", "3"], "--max-np 3 is below -np 4"),
    (["-np", "4", "--elastic", "--reset-limit", "-1"], "--reset-limit -1 must be 0"),
])
def test_bad_elastic_options_are_usage_errors(fake_mpi, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run"] + argv + ["a.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_program_or_np_is_a_usage_error(fake_mpi, capsys):
    for argv in (["run", "-np", "2"], ["run", "a.py"], ["run", "-np", "0", "a.py"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2


def test_no_mpirun_is_a_clear_error_only_where_it_is_asked_for(monkeypatch, capsys):
    monkeypatch.setattr(mpirun_module, "find_mpi_tool", lambda name: None)
    assert cli.main(["run", "--launcher", "mpirun", "-np", "2", "--dry-run", "a.py"]) == 1
    assert "no mpirun found" in capsys.readouterr().err
    # without --launcher, ranks start on this host (or through ssh with -H) instead
    assert cli.main(["run", "-np", "2", "--dry-run", "a.py"]) == 0
    assert "--launcher local" in capsys.readouterr().err
    assert cli.main(["run", "-np", "2", "-H", "a:1,b:1", "--dry-run", "a.py"]) == 0
    assert "--launcher ssh" in capsys.readouterr().err


def test_options_only_mpirun_has_are_refused_without_it(capsys):
    assert cli.main(["run", "--launcher", "local", "-np", "2", "--mpi-args=-x A",
                     "a.py"]) == 1
    assert "--mpi-args: only with --launcher mpirun" in capsys.readouterr().err
    assert cli.main(["run", "--launcher", "ssh", "-np", "2", "a.py"]) == 1
    assert "--launcher ssh needs -H" in capsys.readouterr().err


def test_verbose_prints_command_and_settings(fake_mpi, capsys, monkeypatch):
    launched = []
    monkeypatch.setattr(process, "run_forwarding_signals",
                        lambda cmd, output=None, diagnostics=None: launched.append(cmd) or 0)
    monkeypatch.setenv("RINGSYNC_TIMEOUT_SECONDS", "30")
    assert cli.main(["run", "-np", "2", "--verbose", "a.py"]) == 0
    err = capsys.readouterr().err
    assert "command: " + shlex.join(launched[0]) in err
    assert "RINGSYNC_TIMEOUT_SECONDS=30" in err


# ---------------------------------------------------------------- horovodrun's options


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
        cli.main(["run", "-np", "2", *argv, "a.py"])
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


def test_check_build_prints_doctor_and_exits(fake_mpi, monkeypatch):
    calls = []
    monkeypatch.setattr(doctor, "doctor", lambda: calls.append("doctor") or 0)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--check-build"])  # no -np needed, as horovodrun's
    assert exit_info.value.code == 0 and calls == ["doctor"]
