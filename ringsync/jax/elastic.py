"""Elastic training with JAX: JaxState (see ringsync.elastic).

    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...   # state.params, state.opt_state = step(state.params, state.opt_state, batch)
        state.commit()

JAX arrays are immutable: a snapshot keeps references to them (no copy), a restore puts
them back, and a sync broadcasts every pytree's leaves from the new rank 0 (one
broadcast per dtype) and the other values as Python objects."""
import jax

from ringsync.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                              capture, run)  # (the module's API)
from ringsync.errors import HorovodInternalError  # noqa: F401

from .functions import broadcast_parameters


def _is_pytree_of_arrays(value) -> bool:
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(leaf, jax.Array) for leaf in leaves)


class JaxState(ObjectState):
    """Keyword values that become attributes: pytrees of JAX arrays (parameters, optax
    states) and any picklable Python values (epoch, batch)."""

    def snapshot(self):
        # A commit keeps only finished values: an array still being computed by a step
        # that then fails (a lost rank) would carry that failure into the restore.
        values = jax.block_until_ready({name: getattr(self, name)
                                        for name in self._object_names})
        return {name: value if _is_pytree_of_arrays(value) else capture(value)
                for name, value in values.items()}

    def load_snapshot(self, snapshot) -> None:
        for name, saved in snapshot.items():
            if _is_pytree_of_arrays(saved):
                setattr(self, name, saved)
            else:
                super().load_snapshot({name: saved})

    def broadcast_state(self, root_rank: int) -> None:
        arrays = [n for n in self._object_names if _is_pytree_of_arrays(getattr(self, n))]
        others = [n for n in self._object_names if n not in arrays]
        synced = broadcast_parameters({n: getattr(self, n) for n in arrays}, root_rank)
        for name in arrays:
            setattr(self, name, synced[name])
        values = self._bcast_object({n: getattr(self, n) for n in others}, root_rank)
        super().load_snapshot(values)
