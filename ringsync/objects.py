"""Python objects between ranks: pickled, then moved as bytes by the core's collectives.
Only for peers you trust (unpickling runs code), as in Horovod.

`process_set`: a ProcessSet or Communicator (default: the job's, made by ringsync.init());
root_rank is a rank of the job, as in Horovod, also in a process set."""
import pickle

import numpy as np


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """root_rank's obj (anything picklable: tensors and arrays included) on every rank."""
    import ringsync as rs
    comm = rs._comm(process_set)
    name = name or "broadcast_object"
    mine = comm.world_rank() == root_rank
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if mine else None
    size = comm.broadcast(np.array([0 if payload is None else payload.size], np.int64),
                          root_rank, name=f"{name}.size")
    buf = payload if payload is not None else np.empty(int(size[0]), np.uint8)
    data = comm.broadcast(buf, root_rank, name=f"{name}.data")
    return obj if mine else pickle.loads(data.tobytes())  # the root keeps its own, as Horovod


def allgather_object(obj, name=None, process_set=None):
    """A list of every rank's obj (picklable), in rank order."""
    import ringsync as rs
    comm = rs._comm(process_set)
    name = name or "allgather_object"
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = comm.allgather(np.array([payload.size], np.int64), name=f"{name}.sizes")
    data = comm.allgather(payload, name=f"{name}.data").tobytes()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(data[starts[i]:starts[i + 1]]) for i in range(len(sizes))]
