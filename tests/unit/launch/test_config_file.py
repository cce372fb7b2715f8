"""ringsync.launch.config_file: horovodrun's YAML --config-file."""

import pytest

from ringsync.launch import cli, config_file

from .helpers import dry_run_and_messages, settings_given


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
        cli.main(["run", "-np", "2", "--config-file", str(config), "a.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_yaml_subset():
    assert config_file.parse_config_yaml(
        "a: 'it''s'\nb: \"x\\ty\"\nc: ~\nd: 1e3\ne: -4\nf: Off\ng: plain text # note\n"
        "s:\n\n  k: v#not-a-comment\n") == {
        "a": "it's", "b": "x\ty", "c": None, "d": 1000.0, "e": -4, "f": False,
        "g": "plain text", "s": {"k": "v#not-a-comment"}}
