"""Variables and Python objects between ranks (horovod.tensorflow.functions)."""
import tensorflow as tf

from ringsync import objects

from .mpi_ops import PS, _name, assign, broadcast, broadcast_


def broadcast_variables(variables, root_rank, process_set=PS, inplace=False):
    """Assign root_rank's values to every variable, on every rank. inplace: through
    broadcast_ (the same result: both assign). Eagerly returns None; in a graph, the op
    that assigns them all (tf.group), as Horovod's."""
    variables = list(variables)
    if inplace:
        values = broadcast_(variables, root_rank, process_set=process_set)
    else:
        # Unnamed: eagerly the core matches calls by order and checks shapes and dtypes,
        # so a rank whose model differs gets an error rather than a stall.
        values = [assign(v, broadcast(v, root_rank, name=_name(None, "broadcast_variables"),
                                      process_set=process_set))
                  for v in variables]
    return None if tf.executing_eagerly() else tf.group(*values)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=PS):
    """root_rank's obj (anything picklable) on every rank. session: TensorFlow 1's,
    accepted for Horovod's signature and not needed."""
    return objects.broadcast_object(obj, root_rank, name or type(obj).__name__,
                                    process_set=process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=PS):
    """A function obj -> root_rank's obj (Horovod builds its graph once; here nothing
    needs building)."""
    def broadcast_one(obj):
        return broadcast_object(obj, root_rank, session, name, process_set)
    return broadcast_one


def allgather_object(obj, session=None, name=None, process_set=PS):
    """A list of every rank's obj (picklable), in rank order."""
    return objects.allgather_object(obj, name or type(obj).__name__, process_set=process_set)


def broadcast_global_variables(root_rank):
    """TensorFlow 1's global variables (a tf.Graph run by a tf.compat.v1.Session) assigned
    root_rank's values: an op, as Horovod's. Eagerly there is no such collection: a
    RuntimeError, as Horovod's."""
    if tf.executing_eagerly():
        raise RuntimeError("ringsync.tensorflow.broadcast_global_variables: eager TensorFlow "
                           "has no global variables collection; use "
                           "broadcast_variables(model.variables, root_rank) (Keras: "
                           "BroadcastGlobalVariablesCallback)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


__all__ = ["broadcast_variables", "broadcast_object", "broadcast_object_fn",
           "allgather_object", "broadcast_global_variables"]
