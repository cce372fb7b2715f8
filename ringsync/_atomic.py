"""Files written whole or not at all: checkpoints, flight records, hang report parts.
Pure standard library, below every other module (anything may import it)."""
import os
import threading


def write_atomically(path, data):
    """Write data to a temporary name, fsync it, rename it to path, fsync the folder: path
    then holds either its old content or all of data, whatever happens meanwhile. The
    temporary name is the writing thread's own: two threads of a process writing one path
    (a failure's flight records and SIGTERM's) must not write into each other's file."""
    tmp = temporary_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def temporary_path(path) -> str:
    """Where this thread writes path before renaming it (a writer stopped half way leaves
    it; this thread's next write of path replaces it)."""
    return f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
