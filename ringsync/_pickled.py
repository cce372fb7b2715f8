"""Python objects over a communicator's collectives: pickled to uint8 arrays, a size
exchanged first so every rank knows how much to receive. Below objects.py (the public
calls, which find the communicator) so that the core's own helpers (the timeline) can use
it on the communicator they hold."""
import pickle

import numpy as np


def broadcast_on(comm, obj, root_rank=0, name=None):
    """root_rank's obj (picklable) on every rank of comm; root_rank as comm.broadcast's."""
    name = name or "broadcast_object"
    mine = comm.world_rank() == root_rank
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if mine else None
    size = comm.broadcast(np.array([0 if payload is None else payload.size], np.int64),
                          root_rank, name=f"{name}.size")
    buf = payload if payload is not None else np.empty(int(size[0]), np.uint8)
    data = comm.broadcast(buf, root_rank, name=f"{name}.data")
    return obj if mine else pickle.loads(data.tobytes())  # the root keeps its own


def allgather_on(comm, obj, name=None):
    """A list of every rank's obj (picklable), in comm's rank order."""
    name = name or "allgather_object"
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = comm.allgather(np.array([payload.size], np.int64), name=f"{name}.sizes")
    data = comm.allgather(payload, name=f"{name}.data").tobytes()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[starts[i]:starts[i + 1]]) for i in range(len(sizes))]
