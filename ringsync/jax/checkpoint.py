"""Sharded checkpoints of JAX pytrees (parameters, optax states): every rank writes its
slice of every leaf, and a checkpoint saved on N ranks loads on M (the format:
ringsync.checkpoint).

    import ringsync.jax.checkpoint as ckpt
    ckpt.save(path, {"params": params, "opt_state": opt_state}, step=step)
    state, extra = ckpt.load(path, like={"params": params, "opt_state": opt_state})

Leaves are keyed by their path in the pytree (jax.tree_util.keystr), so a load needs a
pytree of the same structure, shapes and dtypes (`like`: the freshly initialised state,
say), and says which leaf differs. Parts are pickles of numpy arrays and plain values,
read back by an unpickler that admits nothing else: a checkpoint cannot run code.
"""
import io
import pickle

import jax
import jax.numpy as jnp
import numpy as np

from ringsync._context import resolve
from ringsync._requests import even_split
from ringsync.checkpoint import CheckpointError, Codec, Parts, agreed, open_checkpoint, \
    save_generation
from ringsync.process_sets import global_process_set

__all__ = ["CheckpointError", "NumpyCodec", "save", "load"]


class _ArraysOnly(pickle.Unpickler):
    """Plain containers, numbers, strings and numpy arrays (bfloat16 included); nothing
    that could run code."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("ml_dtypes", "bfloat16"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
               ("builtins", "complex"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module.startswith("numpy.dtypes")
                                              and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint part")


class NumpyCodec(Codec):
    """numpy arrays in a checkpoint's parts, pickled; read by _ArraysOnly."""

    def flat_copy(self, tensor):
        return np.array(tensor, copy=True).reshape(-1)

    def numel(self, tensor):
        return int(np.size(tensor))

    def empty(self, n, like):
        return np.empty(n, dtype=like.dtype)

    def dumps(self, part):
        return pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)

    def load(self, file):
        with open(file, "rb") as f:
            return _ArraysOnly(io.BytesIO(f.read())).load()


CODEC = NumpyCodec()


def _leaves(tree):
    return [(jax.tree_util.keystr(path), leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def save(path, tree, process_set=global_process_set, **extra):
    """Save a pytree of arrays to directory `path`: rank r of the set writes the r-th
    even slice of every leaf (all ranks hold the same values, as data-parallel ranks do).
    extra: picklable plain values, returned by load(). Every rank of the set calls it;
    returns the generation number written."""
    comm = resolve(process_set)
    rank, size = comm.rank(), comm.size()
    parts = Parts(CODEC)
    layout = {}
    for key, leaf in _leaves(tree):
        host = np.asarray(leaf).reshape(-1)
        counts = even_split(host.size, size)
        start = sum(counts[:rank])
        parts.add_piece(key, host[start:start + counts[rank]], start, host.size)
        layout[key] = (tuple(np.shape(leaf)), np.dtype(host.dtype).name)
    if rank == 0:
        parts.whole["jax.layout"] = layout
        parts.whole["extra"] = extra
    return save_generation(path, parts, comm, process_set)


def load(path, like, process_set=global_process_set, *, generation=None):
    """(the saved pytree, in `like`'s structure, as JAX arrays; the extra values save()
    was given), whatever the number of ranks it was saved on. generation: the one to load
    (None: the one checkpoint.json names). CheckpointError, on every rank of the set,
    names a damaged file, or a leaf that is missing or whose shape or dtype differs from
    like's."""
    resolve(process_set)  # (a clear error before any file is read, if not initialized)
    reader = open_checkpoint(path, CODEC, process_set, generation=generation)
    return agreed(lambda: _from_reader(reader, like), process_set)


def _from_reader(reader, like):
    layout = reader.whole("jax.layout")
    out = []
    for key, leaf in _leaves(like):
        want = (tuple(np.shape(leaf)), np.dtype(jnp.asarray(leaf).dtype).name)
        if key not in layout:
            raise CheckpointError(f"ringsync.jax.checkpoint: the checkpoint has no leaf {key}")
        if tuple(layout[key][0]) != want[0] or layout[key][1] != want[1]:
            raise CheckpointError(f"ringsync.jax.checkpoint: leaf {key} was saved as "
                                  f"{layout[key][1]}{list(layout[key][0])}, and is "
                                  f"{want[1]}{list(want[0])} here")
        total = int(np.prod(want[0], dtype=np.int64))
        out.append(jnp.asarray(reader.range(key, 0, total, total).reshape(want[0])))
    return jax.tree.unflatten(jax.tree.structure(like), out), reader.whole("extra")
