"""Each rank's torch.distributed ``env://`` variables, as torchrun gives them, so that an
unchanged ``dist.init_process_group("ringsync")`` (or "gloo") runs under ``ringsync run``:

    python -m ringsync.launch.rank_env [--master-addr=HOST] [--master-port=PORT]
                                       -- PROGRAM [ARGS...]

mpirun starts this module as every rank (ringsync.launch.mpirun.rank_command). RANK
differs from process to process, so the launcher cannot hand it out with mpirun's -x:
RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are read here from the MPI launcher's
per-process variables, MASTER_ADDR and MASTER_PORT (the same for all) come as arguments,
and then the program replaces this process (os.execvp: the same PID, so mpirun's signals
reach the program and its exit status is the rank's). As torchrun does, the per-rank
values replace any the launcher's environment handed down (one value there would be
every rank's); MASTER_ADDR / MASTER_PORT the user set are kept (the launcher then passes
no option for them).
"""

from __future__ import annotations

import os
import signal
import sys

from ringsync.errors import LauncherError

USAGE = ("python -m ringsync.launch.rank_env [--master-addr=HOST] [--master-port=PORT] "
         "-- PROGRAM [ARGS...]")

# torch's name -> the variable each MPI launcher sets in every process it starts.
OPEN_MPI_NAMES = {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
                  "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
                  "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"}
HYDRA_NAMES = {"RANK": "PMI_RANK", "WORLD_SIZE": "PMI_SIZE", "LOCAL_RANK": "MPI_LOCALRANKID",
               "LOCAL_WORLD_SIZE": "MPI_LOCALNRANKS"}  # MPICH's and Intel MPI's Hydra

MASTER_OPTIONS = {"--master-addr": "MASTER_ADDR", "--master-port": "MASTER_PORT"}


def parse_arguments(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """({MASTER_ADDR / MASTER_PORT: value} of the options, the program and its arguments).
    The program comes after "--", so that none of its words is ever taken as ours."""
    master = {}
    while argv and argv[0] != "--":
        option, has_value, value = argv[0].partition("=")
        if option not in MASTER_OPTIONS or not has_value:
            raise LauncherError(f"unknown argument {argv[0]!r}; usage: {USAGE}")
        master[MASTER_OPTIONS[option]] = value
        argv = argv[1:]
    if len(argv) < 2:
        raise LauncherError(f"no program given; usage: {USAGE}")
    return master, argv[1:]


def launcher_names(environ) -> dict[str, str]:
    """The per-process names of the MPI launcher that started this process."""
    for names in (OPEN_MPI_NAMES, HYDRA_NAMES):
        if names["RANK"] in environ:
            return names
    raise LauncherError("neither OMPI_COMM_WORLD_RANK (Open MPI) nor PMI_RANK (MPICH/Hydra) "
                        "is set: this process was not started by mpirun")


def rank_variables(environ, master: dict[str, str]) -> dict[str, str]:
    """The env:// variables to set in this rank: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE (from the MPI launcher's), and those of ``master`` that ``environ``
    lacks."""
    names = launcher_names(environ)
    values = {}
    for name in OPEN_MPI_NAMES:
        if names[name] not in environ:  # (an MPI too old or too different to set it)
            raise LauncherError(f"{names[name]} is not set, so this rank's {name} is not "
                                f"known; set {name} yourself")
        values[name] = environ[names[name]]
    values.update((name, value) for name, value in master.items() if name not in environ)
    return values


def main(argv: list[str] | None = None) -> None:
    try:
        master, program = parse_arguments(sys.argv[1:] if argv is None else argv)
        os.environ.update(rank_variables(os.environ, master))
    except LauncherError as exc:
        sys.exit(f"ringsync.launch.rank_env: {exc}")
    # SIGUSR1 asks the ranks for a hang report (ringsync run passes it on, also at the
    # first Ctrl-C): ignored until init() takes it over, so that a rank still importing
    # does not die of it (an ignored signal stays ignored across exec).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        os.execvp(program[0], program)
    except OSError as exc:  # the program could not be started: a shell's statuses
        print(f"ringsync.launch.rank_env: cannot run {program[0]!r}: {exc.strerror}",
              file=sys.stderr)
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main()
