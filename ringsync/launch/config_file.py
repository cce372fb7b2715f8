"""``ringsync run --config-file FILE``: horovodrun's YAML config file.

apply_config_file sets what the file says where the command line said nothing (CONFIG_KEYS
maps its sections and keys to the options they stand for); parse_config_yaml reads the
subset of YAML those files use (PyYAML is not a dependency of ringsync). The option
value types (number_type, log_level_type) live here, shared with the option table of
ringsync.launch.cli, so that a value is checked the same way in the file and on the
command line.
"""

from __future__ import annotations

import argparse
import json
import re

from ringsync.config import LOG_LEVELS

def number_type(kind, low: float = 0, positive: bool = False):
    """An argparse type: a number of ``kind`` that is >= low (> 0 when ``positive``);
    argparse's error names the option."""
    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                "%r is not %s" % (text, "a whole number" if kind is int else "a number"))
        if value != value or value < low or (positive and value == 0):
            raise argparse.ArgumentTypeError(
                "%r must be %s" % (text, "positive" if positive else "zero or more"))
        return value
    parse.__name__ = kind.__name__
    return parse


def log_level_type(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError("%r is not one of %s" % (
            text, ", ".join(level.upper() for level in LOG_LEVELS)))
    return text.lower()


# --------------------------------------------------------------------------- --config-file

# horovodrun's YAML, section -> key -> (the option's dest it sets, its type). None: the
# key is accepted and reported as ignored (as the option it stands for).
CONFIG_KEYS = {
    "params": {"fusion_threshold_mb": ("fusion_threshold_mb", number_type(float)),
               "cycle_time_ms": ("cycle_time_ms", number_type(float)),
               "cache_capacity": ("cache_capacity", number_type(int)),
               "hierarchical_allreduce": ("hierarchical_allreduce", bool),
               "hierarchical_allgather": None},
    "timeline": {"filename": ("timeline_filename", str),
                 "mark_cycles": ("timeline_mark_cycles", bool)},
    "stall_check": {"enabled": ("no_stall_check", "not"),
                    "warning_time_seconds": ("stall_check_warning_time_seconds",
                                             number_type(float)),
                    "shutdown_time_seconds": ("stall_check_shutdown_time_seconds",
                                              number_type(float))},
    "logging": {"level": ("log_level", log_level_type), "with_timestamp": None},
    "autotune": {"enabled": ("autotune", bool), "log_file": ("autotune_log_file", str),
                 "warmup_samples": ("autotune_warmup_samples", number_type(int)),
                 "steps_per_sample": ("autotune_steps_per_sample", number_type(int, positive=True)),
                 "bayes_opt_max_samples": ("autotune_bayes_opt_max_samples",
                                           number_type(int, positive=True)),
                 "gaussian_process_noise": None},
    "library_options": {key: None for key in ("mpi_threads_disable", "num_nccl_streams",
                                              "thread_affinity", "gloo_timeout_seconds")},
}


def apply_config_file(namespace: argparse.Namespace, path: str) -> None:
    """Set what ``path`` (horovodrun's YAML config) says, where the command line said
    nothing (options given there win, as in horovodrun). Unknown sections and keys are
    reported as ignored; bad values raise ValueError naming the key."""
    with open(path, encoding="utf-8") as f:
        config = parse_config_yaml(f.read())
    notes = list(getattr(namespace, "ignored", None) or [])
    for section, values in config.items():
        if section == "controller":
            if str(values).lower() not in ("mpi", "gloo"):
                raise ValueError("controller: %r is not mpi or gloo" % (values,))
            if namespace.controller is None:
                namespace.controller = str(values).lower()
            continue
        keys = CONFIG_KEYS.get(section)
        if keys is None or not isinstance(values, dict):
            notes.append("%s in %s (not a section horovodrun reads)" % (section, path))
            continue
        for key, value in values.items():
            where = "%s.%s" % (section, key)
            if key not in keys:
                notes.append("%s in %s (not a key horovodrun reads)" % (where, path))
                continue
            if keys[key] is None:
                notes.append("%s in %s (no meaning in ringsync)" % (where, path))
                continue
            dest, kind = keys[key]
            if value is None or getattr(namespace, dest) is not None:
                continue  # not set, or the command line's
            if kind in (bool, "not"):
                if not isinstance(value, bool):
                    raise ValueError("%s: %r is not true or false" % (where, value))
                value = (not value) if kind == "not" else value
            else:
                try:
                    value = kind(value if kind is str else str(value))
                except argparse.ArgumentTypeError as exc:
                    raise ValueError("%s: %s" % (where, exc)) from None
            setattr(namespace, dest, value)
    namespace.ignored = notes


def parse_config_yaml(text: str) -> dict:
    """The subset of YAML that horovodrun's config file uses: top-level ``key: value``
    pairs and sections of ``key: value`` pairs (one level of indentation), with
    comments, quoted strings, booleans (true/false/yes/no/on/off), null, integers and
    floats. Anything else (lists, nested sections, flow style) is a ValueError naming
    the line. (Written here: PyYAML is not a dependency of ringsync.)"""
    result, section = {}, None
    for number, raw in enumerate(text.splitlines(), 1):
        line = _strip_comment(raw).rstrip()
        if not line.strip() or line.strip() in ("---", "..."):
            continue
        if "\t" in line[:len(line) - len(line.lstrip())]:
            raise ValueError("line %d: a tab in the indentation" % number)
        match = re.match(r"^(\s*)([A-Za-z_][\w.-]*)\s*:(?:\s+(.*))?$", line)
        if not match:
            raise ValueError("line %d: expected 'key: value', got %r" % (number, raw.strip()))
        indent, key, value = match.groups()
        if not indent:
            if value is None:
                section = result[key] = {}
            else:
                result[key], section = _yaml_scalar(value, number), None
        elif section is None:
            raise ValueError("line %d: %r is indented but belongs to no section" % (number, key))
        elif value is None:
            raise ValueError("line %d: %r: nested sections are not supported" % (number, key))
        else:
            section[key] = _yaml_scalar(value, number)
    return result


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment (a ``#`` inside quotes, or inside a word, stays)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _yaml_scalar(text: str, number: int):
    text = text.strip()
    if text[:1] in "[{|>&*!":
        raise ValueError("line %d: %r: only plain values are supported" % (number, text))
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1].replace("''", "'")
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return json.loads(text)
    lowered = text.lower()
    if lowered in ("null", "~", ""):
        return None
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        return float(text)
    return text
