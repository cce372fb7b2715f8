"""What the launcher tests share: the pretend mpirun's path (the fake_mpi fixture, in
conftest.py, installs it) and `ringsync run --dry-run`'s command, read back."""

import shlex

from ringsync.launch import cli

FAKE_MPIRUN = "/opt/mpi/bin/mpirun"


def dry_run(capsys, *argv):
    """The mpirun command `ringsync run --dry-run ...` prints, as a list."""
    return dry_run_and_messages(capsys, *argv)[0]


def dry_run_and_messages(capsys, *argv):
    """(dry_run's command, what the launcher printed on stderr)."""
    assert cli.main(["run", "--dry-run", *argv]) == 0
    printed = capsys.readouterr()
    return shlex.split(printed.out), printed.err


def program_part(command, first_word):
    return command[command.index(first_word):]


def rank_program(command):
    """The program each rank runs: what follows ringsync.launch.rank_env's "--"."""
    return command[command.index("--", command.index("ringsync.launch.rank_env")) + 1:]


def settings_given(command) -> dict:
    """{NAME: value} of the `-x NAME=value` pairs in an mpirun command."""
    return dict(command[i + 1].split("=", 1) for i, word in enumerate(command)
                if word == "-x" and "=" in command[i + 1])
