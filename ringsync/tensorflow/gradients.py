"""Gradient averaging for TensorFlow: DistributedGradientTape, PartialDistributedGradientTape
and the reduction rules that they and the Keras DistributedOptimizer share (Horovod's
arguments: compression, op, gradient_predivide_factor, groups, sparse_as_dense, process
sets, local sources and scale_local_gradients)."""
import zlib

import tensorflow as tf

from ringsync import Average, ReduceOp
from ringsync._adapters import groups_from_num_groups, near_equal_runs
from ringsync.errors import UsageError
from ringsync.process_sets import ProcessSet

from .compression import Compression
from .fused import fused_allreduce
from .mpi_ops import PS, _comm, grouped_allreduce


def variable_key(variable):
    """A hashable identity for a tf.Variable or a Keras 3 Variable (which has no ref())."""
    return variable.ref() if hasattr(variable, "ref") else ("keras", id(variable))


def is_variable(value) -> bool:
    import keras
    return isinstance(value, (tf.Variable, keras.Variable))


class GradientReducer:
    """How the gradients of one tape or optimizer travel: checked once, used every step."""

    def __init__(self, compression=Compression.none, op=Average, gradient_predivide_factor=1.0,
                 sparse_as_dense=False, num_groups=0, groups=None, process_set=PS,
                 scale_local_gradients=True, what="DistributedGradientTape"):
        op = ReduceOp(op)
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
            raise UsageError(f"ringsync.tensorflow.{what}: op must be Average, Sum or Adasum "
                             f"for gradients, got {op.name.title()}")
        if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
            raise UsageError(f"ringsync.tensorflow.{what}: gradient_predivide_factor="
                             f"{gradient_predivide_factor} applies to op=Average only, "
                             f"got op={op.name}")
        self.groups = _check_groups(groups_from_num_groups(num_groups, groups), what)
        self.compression, self.op = compression, op
        self.predivide = float(gradient_predivide_factor)
        self.sparse_as_dense, self.process_set = sparse_as_dense, process_set
        self.scale_local = scale_local_gradients
        self.local_variables = {}  # key -> variable whose gradient stays on this rank

    def register_local(self, variable) -> None:
        self.local_variables[variable_key(variable)] = variable

    def is_local(self, variable) -> bool:
        return variable is not None and variable_key(variable) in self.local_variables

    def reduce(self, grads, variables, name):
        """grads averaged (or summed) over the set; local variables' gradients only
        scaled; None stays None. On a rank outside the set, every gradient stays as it is
        (Horovod's rule: that rank trains on its own gradients)."""
        grads = list(grads)
        if _outside(self.process_set):
            return grads
        variables = list(variables) if variables is not None else [None] * len(grads)
        out = list(grads)
        shared = []
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                continue
            if self.sparse_as_dense and isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
                out[i] = g
            if self.is_local(v):
                out[i] = self._scaled_local(g)
            else:
                shared.append(i)
        for number, run in enumerate(self._runs(shared, variables)):
            reduced = self._reduce_run([out[i] for i in run], f"{name}.{number}")
            for i, r in zip(run, reduced):
                out[i] = r
        return out

    def _reduce_run(self, grads, name):
        """One group's gradients: fused into one buffer per dtype (see fused.py), but for
        Adasum, whose coefficients belong to each tensor."""
        if self.op == ReduceOp.ADASUM:
            return grouped_allreduce(grads, compression=self.compression, op=self.op,
                                     process_set=self.process_set, name=name, **self._scale())
        return fused_allreduce(grads, name, self.op, process_set=self.process_set,
                               compression=self.compression, **self._scale())

    def _scale(self):
        if self.op == ReduceOp.AVERAGE and self.predivide != 1.0:
            return dict(prescale_factor=1.0 / self.predivide, postscale_factor=self.predivide)
        return {}

    def _scaled_local(self, g):
        if not self.scale_local:
            return g
        size = _comm(self.process_set).size()
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values / tf.cast(size, g.values.dtype), g.indices,
                                    g.dense_shape)
        return g / tf.cast(size, g.dtype)

    def _runs(self, shared, variables):
        """Indices of the gradients reduced together: all in one group by default; with
        groups=N, N runs of nearly equal length; with lists of variables, those lists
        (gradients of variables in no list alone)."""
        if not shared:
            return []
        if self.groups is None:
            return [shared]
        if isinstance(self.groups, int):
            return [run for run in near_equal_runs(shared, self.groups) if run]
        group_of = {variable_key(v): k for k, group in enumerate(self.groups) for v in group}
        runs = {}
        for i in shared:
            v = variables[i]
            key = group_of.get(variable_key(v), ("alone", i)) if v is not None else ("alone", i)
            runs.setdefault(key, []).append(i)
        return list(runs.values())


def _outside(process_set) -> bool:
    """Whether this rank is outside process_set (a Communicator is always its own)."""
    return isinstance(process_set, ProcessSet) and process_set.included() is False


def _check_groups(groups, what):
    if groups is None:
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1:
            raise UsageError(f"ringsync.tensorflow.{what}: groups must be a positive int or "
                             f"a list of lists of tf.Variable, got {groups}")
        return groups
    if isinstance(groups, (list, tuple)):
        lists = [list(g) for g in groups]
        if not all(is_variable(v) for g in lists for v in g):
            raise UsageError(f"ringsync.tensorflow.{what}: groups must be a positive int or "
                             f"a list of lists of tf.Variable")
        refs = [variable_key(v) for g in lists for v in g]
        if len(refs) != len(set(refs)):
            raise UsageError(f"ringsync.tensorflow.{what}: a variable appears in more than "
                             f"one group")
        return lists
    raise UsageError(f"ringsync.tensorflow.{what}: groups must be a positive int or a list "
                     f"of lists of tf.Variable, got {type(groups).__name__}")


def gradients_name(sources) -> str:
    """The same on every rank for the same variables, however many tapes each process
    made before (a rank that replaced a lost one has made fewer), and the same every
    step, so that the negotiation cache recognises it."""
    described = ";".join(f"{getattr(s, 'name', '?')}{tuple(s.shape)}"
                         for s in tf.nest.flatten(sources))
    return f"tape.grads.{zlib.crc32(described.encode()):08x}"


class DistributedGradientTape:
    """Wraps a tf.GradientTape: gradient() returns gradients averaged over the ranks of
    process_set (except for registered local sources). The tape's other methods (watch,
    stop_recording, ...) are the wrapped tape's."""

    def __init__(self, gradtape, device_dense='', device_sparse='',
                 compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=PS,
                 scale_local_gradients=True):
        self._tape = gradtape
        self._reducer = GradientReducer(compression, op, gradient_predivide_factor,
                                        sparse_as_dense, num_groups, groups, process_set,
                                        scale_local_gradients, type(self).__name__)

    def __getattr__(self, attr):
        return getattr(self._tape, attr)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def register_local_source(self, source):
        """source's gradient stays on this rank (divided by the set's size when
        scale_local_gradients)."""
        self._reducer.register_local(source)

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(grads)
        reduced = self._reducer.reduce(flat, flat_sources, gradients_name(sources))
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """([(local source, gradient)], [(shared source, gradient)])."""
        flat_sources = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients))
        pairs = list(zip(flat_sources, grads))
        return ([p for p in pairs if self._reducer.is_local(p[0])],
                [p for p in pairs if not self._reducer.is_local(p[0])])


class PartialDistributedGradientTape(DistributedGradientTape):
    """A DistributedGradientTape whose local_layers' trainable weights are local sources:
    model parallelism for those layers, data parallelism for the rest."""

    def __init__(self, gradtape, device_dense='', device_sparse='',
                 compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=PS,
                 local_layers=None, scale_local_gradients=True):
        super().__init__(gradtape, device_dense, device_sparse, compression, sparse_as_dense,
                         op, gradient_predivide_factor, num_groups, groups, process_set,
                         scale_local_gradients)
        for layer in _layers(local_layers, type(self).__name__):
            for weight in layer.trainable_weights:
                self.register_local_source(weight)


def _layers(local_layers, what):
    if local_layers is None:
        return []
    import keras
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else \
        list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise UsageError(f"ringsync.tensorflow.{what}: local_layers must be a Keras layer or "
                         f"a list of them")
    return layers


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='',  # noqa: N802
                         device_sparse='', compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=PS, scale_local_gradients=True):
    """horovod.tensorflow.DistributedOptimizer: a Keras optimizer wrapped by
    ringsync.tensorflow.keras.DistributedOptimizer, with every argument passed on (also
    op and groups, which Horovod drops there). TensorFlow 1's tf.compat.v1.train
    optimizers are not supported: use a Keras optimizer, or DistributedGradientTape."""
    import keras
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise UsageError(f"ringsync.tensorflow.DistributedOptimizer wraps a Keras optimizer "
                         f"(keras.optimizers.*), got {type(optimizer).__module__}."
                         f"{type(optimizer).__name__}; for a custom training loop use "
                         f"DistributedGradientTape")
    from .keras import DistributedOptimizer as KerasDistributedOptimizer
    return KerasDistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
