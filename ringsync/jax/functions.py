"""Parameters and Python objects between ranks, for JAX pytrees."""
import jax
import jax.numpy as jnp
import numpy as np

from ringsync import objects
from ringsync.errors import UsageError

from .mpi_ops import PS, _comm, settle


def _by_dtype(leaves):
    """{dtype: [leaf indices]} in first-seen order (the same on every rank whose pytree
    has the same structure)."""
    groups = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(np.dtype(leaf.dtype), []).append(i)
    return groups


def broadcast_parameters(params, root_rank=0, process_set=PS):
    """root_rank's values of a pytree of arrays (a model's parameters, an optax state),
    returned as a new pytree of the same structure on every rank of the set. JAX arrays
    are immutable, so the result replaces the caller's: ``params =
    hvd.broadcast_parameters(params, root_rank=0)``. One broadcast per dtype."""
    leaves, tree = jax.tree.flatten(params)
    host = []
    for i, leaf in enumerate(leaves):
        if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            raise UsageError(f"ringsync.jax.broadcast_parameters: leaf {i} of the pytree is a "
                             f"{type(leaf).__name__}, not an array (broadcast_object carries "
                             f"Python values)")
        host.append(np.asarray(leaf))
    settle()
    comm = _comm(process_set)
    out = list(host)
    for dtype, where in _by_dtype(host).items():
        flat = np.concatenate([host[i].reshape(-1) for i in where])
        flat = comm.broadcast(flat, root_rank, None)
        start = 0
        for i in where:
            n = host[i].size
            out[i] = flat[start:start + n].reshape(host[i].shape)
            start += n
    return jax.tree.unflatten(tree, [jnp.asarray(o) for o in out])


def broadcast_object(obj, root_rank=0, name=None, process_set=PS):
    """root_rank's obj (anything picklable, JAX arrays included) on every rank."""
    settle()
    return objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=PS):
    """A list of every rank's obj (picklable), in rank order."""
    settle()
    return objects.allgather_object(obj, name, process_set)
