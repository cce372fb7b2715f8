"""ringsync.launch.hosts: slots of this host, of -H lists and hostfiles, and the
oversubscription they decide."""

import sys

from .helpers import dry_run, program_part, rank_program


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
    assert program_part(command, "--map-by")[:3] == ["--map-by", "node", sys.executable]
    assert rank_program(command) == [sys.executable, "a.py"]


def test_hostfile_passes_through_and_its_slots_count(fake_mpi, capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=2\nnode2 slots=1  # small one\n\n")
    command = dry_run(capsys, "-np", "3", "--hostfile", str(hostfile), "a.py")
    assert command[command.index("--hostfile") + 1] == str(hostfile)
    assert "--oversubscribe" not in command
    assert oversubscribes_by_slot(dry_run(capsys, "-np", "4", "--hostfile", str(hostfile), "a.py"))
