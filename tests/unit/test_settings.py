"""Settings are described once (Config's field metadata); parsing, the launcher's doctor,
--verbose and exports, and the README table must all follow that description."""

import dataclasses
import math
import os
import re

import pytest

from ringsync.config import (AGREED_SETTINGS, ENV_PREFIX, INT64_MAX, Config, Setting,
                             default_in_words, setting_fields, settings_table, within_bounds)
from ringsync.errors import UsageError
from ringsync.launch import cli, doctor, hosts
from ringsync.launch import mpirun as mpirun_module

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
REGENERATE = ("print the table with: python -c 'from ringsync.config import settings_table; "
              "print(settings_table())'")


def readme_settings_rows():
    """{variable: row's cells} from the README's "### Settings" table."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("### Settings\n"):]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break  # the next section
        match = re.match(r"\| `(RINGSYNC_\w+)` \|", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in line.strip("|").split(" | ")]
    return rows


def test_every_field_carries_a_complete_setting():
    for f in dataclasses.fields(Config):
        setting = f.metadata.get("setting")
        assert isinstance(setting, Setting), f"Config.{f.name} has no Setting metadata"
        assert setting.env == ENV_PREFIX + f.name.upper(), f.name
        assert setting.help and "\n" not in setting.help and "|" not in setting.help, f.name
        if f.default is None or (setting.default_text and isinstance(f.default, (int, float))):
            assert setting.default_text, f"{f.name}: a stand-in default needs its meaning"


def test_defaults_lie_within_their_bounds():
    for f, setting in setting_fields():
        if isinstance(f.default, (int, float)) and not setting.default_text:
            assert within_bounds(setting, f.default), f"{setting.env} default {f.default}"


def test_agreed_settings_come_from_the_metadata():
    assert AGREED_SETTINGS == tuple(f.name for f, s in setting_fields() if s.agreed)
    assert set(Config.from_env({}).agreed()) == set(AGREED_SETTINGS)


def test_readme_table_is_the_metadata():
    rows = readme_settings_rows()
    envs = [setting.env for _, setting in setting_fields()]
    assert list(rows) == envs, f"README rows differ from Config's settings; {REGENERATE}"
    for f, setting in setting_fields():
        variable, default, *_ = rows[setting.env]
        assert default == default_in_words(f), f"{setting.env}: README default {default!r}"
    with open(README, encoding="utf-8") as readme:
        assert settings_table() in readme.read(), f"README table is stale; {REGENERATE}"


def test_readme_lane_bytes_is_the_code_default():
    # The drift that started this: the README said 1 MiB while the code has 1 GiB.
    assert readme_settings_rows()["RINGSYNC_LANE_BYTES"][1].startswith(
        str(Config().lane_bytes))


@pytest.mark.parametrize("f, setting", setting_fields(),
                         ids=[f.name for f, _ in setting_fields()])
def test_from_env_respects_bounds(f, setting):
    if not isinstance(f.default, (int, float)):
        assert getattr(Config.from_env({setting.env: "some text"}), f.name) == "some text"
        return
    low = setting.minimum
    if not setting.positive:
        assert getattr(Config.from_env({setting.env: str(int(low))}), f.name) == low
    kind_bad = ["nan"] if isinstance(f.default, float) else []  # NaN is no whole number
    for bad in [low - 1] + kind_bad + ([0] if setting.positive else []):
        with pytest.raises(UsageError, match=f"{setting.env}='{bad}' must be"):
            Config.from_env({setting.env: str(bad)})
    if setting.maximum is not None:
        top = int(setting.maximum)
        assert getattr(Config.from_env({setting.env: str(top)}), f.name) == top
        with pytest.raises(UsageError, match=f"{setting.env}='{top + 1}' must be .*at most"):
            Config.from_env({setting.env: str(top + 1)})
    if isinstance(f.default, int):
        with pytest.raises(UsageError, match=f"{setting.env}='1.5' is not a whole number"):
            Config.from_env({setting.env: "1.5"})


def test_byte_counts_fit_the_native_int64():
    for f, setting in setting_fields():
        if setting.unit == "bytes":
            assert setting.maximum == INT64_MAX, setting.env


def test_unset_or_empty_takes_the_default():
    for f, setting in setting_fields():
        assert getattr(Config.from_env({setting.env: ""}), f.name) == f.default
    assert Config.from_env({}) == Config()


def test_doctor_lists_every_setting_with_value_and_source():
    environ = {"RINGSYNC_FUSION_THRESHOLD": "0", "RINGSYNC_CACHE_CAPACITY": "x",
               "RINGSYNC_SPIN_US": "2e6", "RINGSYNC_TRANSPORT": "udp",
               "RINGSYNC_LANE_BYTE": "5"}
    lines = doctor.settings_report(environ)
    for f, setting in setting_fields():
        line = next((l for l in lines if re.match(rf"{setting.env}\b", l)), None)
        assert line is not None, f"doctor does not list {setting.env}"
        assert ("environment" if setting.env in environ else "default") in line, line
    by_name = {l.split("=")[0].split()[0]: l for l in lines}
    assert "(0: no fusion)" in by_name["RINGSYNC_FUSION_THRESHOLD"]
    assert "is not a whole number" in by_name["RINGSYNC_CACHE_CAPACITY"]
    assert "at most 1000000" in by_name["RINGSYNC_SPIN_US"]
    assert "not one of auto, tcp, shm" in by_name["RINGSYNC_TRANSPORT"]
    assert "default (1 GiB)" in by_name["RINGSYNC_LANE_BYTES"]
    assert "not a ringsync setting" in by_name["RINGSYNC_LANE_BYTE"]  # a misspelling


def test_doctor_prints_the_settings(monkeypatch, capsys):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")  # doctor sets it; restored afterwards
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RINGSYNC_TIMEOUT_SECONDS", "30")
    for name, describe in [("mpirun.find_mpirun", lambda: "/opt/mpi/bin/mpirun"),
                           ("mpirun.mpi_flavor", lambda mpirun: mpirun_module.OPEN_MPI),
                           ("doctor.mpi_library", lambda: "MPI"),
                           ("doctor.ulfm_support", lambda: "no"),
                           ("doctor.mpi4py_version", lambda: "4"),
                           ("doctor.framework_version", lambda name: "not installed")]:
        monkeypatch.setattr("ringsync.launch." + name, describe)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for _, setting in setting_fields():
        assert "\n  " + setting.env in out, setting.env
    assert re.search(r"RINGSYNC_TIMEOUT_SECONDS=30 +environment", out)


def test_exports_follow_the_settings_list(monkeypatch):
    environ = {"RINGSYNC_ELASTIC_MIN_NP": "2", "RINGSYNC_TEST_DIR": "/tmp/x",
               "RINGSYNC_FUSION_THRESHOLD": "1", "PATH": "/bin", "OTHER": "y"}
    # Settings first (Config's order), then other RINGSYNC_*, then the rest, sorted.
    assert mpirun_module.exported_variables(environ) == [
        "RINGSYNC_FUSION_THRESHOLD", "RINGSYNC_ELASTIC_MIN_NP", "RINGSYNC_TEST_DIR", "OTHER",
        "PATH"]
    options = mpirun_module.RunOptions(np=2, program=["a.py"], elastic=True, min_np=2,
                                       respawn=True)
    names = {f.name: s.env for f, s in setting_fields()}
    assert mpirun_module.elastic_settings(options) == {names["elastic_min_np"]: "2",
                                                       names["elastic_respawn"]: "1"}
    monkeypatch.setattr(hosts, "local_slots", lambda: 4)
    command = mpirun_module.build_mpirun_command(options, mpirun="mpirun",
                                                 flavor=mpirun_module.OPEN_MPI, environ=environ)
    # The option's value alone reaches the ranks, not also the variable it replaces.
    assert command.count("RINGSYNC_ELASTIC_MIN_NP") == 0
    assert "RINGSYNC_ELASTIC_MIN_NP=2" in command


def test_spin_bound_is_infinite_safe():
    with pytest.raises(UsageError, match="RINGSYNC_SPIN_US='inf' must be"):
        Config.from_env({"RINGSYNC_SPIN_US": "inf"})
    assert math.isinf(Config.from_env({"RINGSYNC_TIMEOUT_SECONDS": "inf"}).timeout_seconds)


# ---------------------------------------------------------------- Horovod's variables

@pytest.mark.parametrize("environ, field, value", [
    ({"HOROVOD_FUSION_THRESHOLD": "1048576"}, "fusion_threshold", 1 << 20),  # bytes both
    ({"HOROVOD_CYCLE_TIME": "3.5"}, "cycle_time_ms", 3.5),  # ms both
    ({"HOROVOD_CACHE_CAPACITY": "0"}, "cache_capacity", 0),
    ({"HOROVOD_TIMELINE": "/tmp/hvd.json"}, "timeline", "/tmp/hvd.json"),
    ({"HOROVOD_TIMELINE": "DYNAMIC"}, "timeline", None),  # start_timeline() always works
    ({"HOROVOD_TIMELINE_MARK_CYCLES": "1"}, "timeline_mark_cycles", 1),
    ({"HOROVOD_TIMELINE_MARK_CYCLES": "true"}, "timeline_mark_cycles", 0),  # strtol, as Horovod
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "30"}, "stall_check_seconds", 30.0),
    ({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30"},
     "stall_check_seconds", 0.0),
    ({"HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "30"},
     "stall_check_seconds", 30.0),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "240"}, "timeout_seconds", 240.0),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, "hierarchical_allreduce", "on"),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, "hierarchical_allreduce", "off"),
    ({"HOROVOD_LOG_LEVEL": "DEBUG"}, "log_level", "debug"),
    ({"HOROVOD_LOG_LEVEL": "chatty"}, "log_level", "warning"),  # Horovod's fallback
    ({"HOROVOD_GLOO_IFACE": "eth1"}, "iface", "eth1"),
    ({"HOROVOD_START_TIMEOUT": "45"}, "start_timeout_seconds", 45.0),
    # RINGSYNC_* wins over Horovod's variable.
    ({"HOROVOD_CYCLE_TIME": "3.5", "RINGSYNC_CYCLE_TIME_MS": "7"}, "cycle_time_ms", 7.0),
    ({"HOROVOD_STALL_CHECK_DISABLE": "1", "RINGSYNC_STALL_CHECK_SECONDS": "9"},
     "stall_check_seconds", 9.0),
])
def test_horovod_variables_are_aliases(environ, field, value):
    assert getattr(Config.from_env(environ), field) == value


def test_every_alias_is_a_horovod_variable_read_once():
    seen = [a.env for _, setting in setting_fields() for a in setting.aliases]
    assert len(seen) == len(set(seen)) and all(name.startswith("HOROVOD_") for name in seen)


def test_a_bad_alias_value_names_the_horovod_variable():
    with pytest.raises(UsageError, match="HOROVOD_FUSION_THRESHOLD='64MB' is not a whole"):
        Config.from_env({"HOROVOD_FUSION_THRESHOLD": "64MB"})


def test_doctor_names_the_horovod_variable_a_value_comes_from():
    lines = doctor.settings_report({"HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_AUTOTUNE": "1",
                                      "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
                                      "HOROVOD_STALL_CHECK_DISABLE": "1"})
    by_name = {l.split("=")[0].split()[0]: l for l in lines}
    assert re.search(r"RINGSYNC_CYCLE_TIME_MS=3.5 +environment \(HOROVOD_CYCLE_TIME\)",
                     by_name["RINGSYNC_CYCLE_TIME_MS"])
    assert re.search(r"RINGSYNC_STALL_CHECK_SECONDS=0 +environment "
                     r"\(HOROVOD_STALL_CHECK_DISABLE\) \(0: never\)",
                     by_name["RINGSYNC_STALL_CHECK_SECONDS"])
    assert re.search(r"RINGSYNC_AUTOTUNE=1 +environment \(HOROVOD_AUTOTUNE\)",
                     by_name["RINGSYNC_AUTOTUNE"])
    assert "a Horovod variable ringsync does not read" in \
        by_name["HOROVOD_HIERARCHICAL_ALLGATHER"]


def test_readme_names_each_settings_horovod_variable():
    rows = readme_settings_rows()
    for _, setting in setting_fields():
        for alias in setting.aliases:
            assert f"`{alias.env}`" in rows[setting.env][4], setting.env


def test_log_level_threshold():
    from ringsync.config import log_enabled
    assert log_enabled("warning", {}) and not log_enabled("info", {})
    assert log_enabled("info", {"HOROVOD_LOG_LEVEL": "info"})
    assert not log_enabled("warning", {"RINGSYNC_LOG_LEVEL": "ERROR"})
    assert log_enabled("warning", {"RINGSYNC_LOG_LEVEL": "nonsense"})  # init() names it
