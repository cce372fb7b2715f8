"""Files written whole or not at all: checkpoints, flight records, hang report parts.
Pure standard library, below every other module (anything may import it)."""
import os


def write_atomically(path, data):
    """Write data to a temporary name, fsync it, rename it to path, fsync the folder: path
    then holds either its old content or all of data, whatever happens meanwhile."""
    tmp = f"{path}.tmp-{os.getpid()}"
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
