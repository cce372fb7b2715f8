"""Python objects between ranks: pickled, then moved as bytes by the core's collectives.
Only for peers you trust (unpickling runs code), as in Horovod.

`process_set`: a ProcessSet or Communicator (default: the job's, made by ringsync.init());
root_rank is a rank of the job, as in Horovod, also in a process set."""
from ._context import resolve
from ._pickled import allgather_on, broadcast_on


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """root_rank's obj (anything picklable: tensors and arrays included) on every rank."""
    return broadcast_on(resolve(process_set), obj, root_rank, name)


def allgather_object(obj, name=None, process_set=None):
    """A list of every rank's obj (picklable), in rank order."""
    return allgather_on(resolve(process_set), obj, name)
