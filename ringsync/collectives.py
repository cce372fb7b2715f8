"""The collectives on the job's default communicator (or the process set given), as
Horovod's module-level functions: each resolves its communicator and hands on."""
from ._context import owner, resolve
from .ops import ReduceOp

Average = ReduceOp.AVERAGE


def allreduce(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().allreduce(tensor, op, prescale_factor, postscale_factor, name)


def allreduce_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().allreduce_(tensor, op, prescale_factor, postscale_factor, name)


def allreduce_async(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().allreduce_async(tensor, op, prescale_factor, postscale_factor, name)


def allreduce_async_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().allreduce_async_(tensor, op, prescale_factor, postscale_factor, name)


def grouped_allreduce(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().grouped_allreduce(tensors, op, prescale_factor, postscale_factor, name)


def grouped_allreduce_(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().grouped_allreduce_(tensors, op, prescale_factor, postscale_factor, name)


def grouped_allreduce_async(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                            name=None):
    return resolve().grouped_allreduce_async(tensors, op, prescale_factor, postscale_factor, name)


def grouped_allreduce_async_(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                             name=None):
    return resolve().grouped_allreduce_async_(tensors, op, prescale_factor, postscale_factor, name)


def allgather(tensor, name=None):
    return resolve().allgather(tensor, name)


def allgather_async(tensor, name=None):
    return resolve().allgather_async(tensor, name)


def broadcast(tensor, root_rank, name=None):
    return resolve().broadcast(tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None):
    return resolve().broadcast_(tensor, root_rank, name)


def broadcast_async(tensor, root_rank, name=None):
    return resolve().broadcast_async(tensor, root_rank, name)


def broadcast_async_(tensor, root_rank, name=None):
    return resolve().broadcast_async_(tensor, root_rank, name)


def reducescatter(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().reducescatter(tensor, op, prescale_factor, postscale_factor, name)


def reducescatter_async(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().reducescatter_async(tensor, op, prescale_factor, postscale_factor, name)


def reducescatter_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return resolve().reducescatter_(tensor, op, prescale_factor, postscale_factor, name)


def reducescatter_async_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                         name=None):
    return resolve().reducescatter_async_(tensor, op, prescale_factor, postscale_factor, name)


def alltoall(tensor, splits=None, name=None):
    return resolve().alltoall(tensor, splits, name)


def alltoall_async(tensor, splits=None, name=None):
    return resolve().alltoall_async(tensor, splits, name)


def send(tensor, dst, name=None, process_set=None):
    """Send tensor to rank dst (of process_set, when given); returns once dst received it."""
    return resolve(process_set).send(tensor, dst, name)


def send_async(tensor, dst, name=None, process_set=None):
    return resolve(process_set).send_async(tensor, dst, name)


def recv(tensor, src, name=None, process_set=None):
    """Receive rank src's message into tensor (preallocated: the sender's dtype and shape)."""
    return resolve(process_set).recv(tensor, src, name)


def recv_async(tensor, src, name=None, process_set=None):
    return resolve(process_set).recv_async(tensor, src, name)


def barrier(process_set=None):
    resolve(process_set).barrier()


def join() -> int:
    """Declare that this rank has no more data; returns the last rank to join (Horovod)."""
    return resolve().join()


def poll(handle) -> bool:
    """True once the handle's collective has completed."""
    return owner(handle).poll(handle)


def synchronize(handle):
    """Wait for an async handle; returns its result or raises its error."""
    return owner(handle).synchronize(handle)
