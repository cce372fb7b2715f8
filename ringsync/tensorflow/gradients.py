"""Gradient averaging for TensorFlow: DistributedGradientTape, PartialDistributedGradientTape,
the Keras DistributedOptimizer (ringsync.tensorflow.keras's) and the reduction rules that
they share (Horovod's arguments: compression, op, gradient_predivide_factor, groups,
sparse_as_dense, process sets, local sources and scale_local_gradients)."""
import itertools
import zlib

import keras
import tensorflow as tf

from ringsync._adapters import groups_from_num_groups, near_equal_runs
from ringsync._context import resolve
from ringsync.errors import UsageError
from ringsync.ops import ReduceOp
from ringsync.process_sets import ProcessSet

from .compression import Compression
from .fused import fused_allreduce
from .mpi_ops import PS, grouped_allreduce

Average = ReduceOp.AVERAGE


def variable_key(variable):
    """A hashable identity for a tf.Variable or a Keras 3 Variable (which has no ref())."""
    return variable.ref() if hasattr(variable, "ref") else ("keras", id(variable))


def is_variable(value) -> bool:
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
        size = resolve(self.process_set).size()
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
        for layer in keras_layers(local_layers, type(self).__name__):
            for weight in layer.trainable_weights:
                self.register_local_source(weight)


def keras_layers(local_layers, what):
    """local_layers (a Keras layer, a list of them, or None) as a list; UsageError naming
    `what` for anything else."""
    if local_layers is None:
        return []
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
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise UsageError(f"ringsync.tensorflow.DistributedOptimizer wraps a Keras optimizer "
                         f"(keras.optimizers.*), got {type(optimizer).__module__}."
                         f"{type(optimizer).__name__}; for a custom training loop use "
                         f"DistributedGradientTape")
    return KerasDistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)


_instances = itertools.count()  # wrappers made in this process, in order (the same on all ranks)
_COMPRESSIONS = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}


def _compression_name(compression) -> str:
    for key, value in _COMPRESSIONS.items():
        if compression is value:
            return key
    return "custom"  # (a user's own Compressor: not saved with the model)


# ---- the Keras optimizer wrapper (ringsync.tensorflow.keras.DistributedOptimizer) ----

@keras.saving.register_keras_serializable(package="ringsync", name="DistributedOptimizer")
class KerasDistributedOptimizer(keras.optimizers.Optimizer):
    """ringsync.tensorflow.keras.DistributedOptimizer. Horovod's arguments, each honoured:

    compression: how gradients travel (Compression.none / fp16 / bf16, or your own).
    sparse_as_dense: IndexedSlices gradients (embeddings) densified before the reduction
        instead of gathered.
    gradient_predivide_factor f: op=Average only; gradients are divided by f before the
        sum and by size/f after it.
    op: Average (default), Sum or Adasum (of the gradients, as Horovod's tape does).
    backward_passes_per_step k: gradients summed locally over k calls, then reduced and
        applied once (the other calls change no weight); average_aggregated_gradients
        divides that sum by k.
    num_groups / groups: gradients reduced in groups (an int: that many runs of nearly
        equal length; lists of variables: those groups); default: all in one group.
    process_set: the ranks that average (a ProcessSet).
    scale_local_gradients: gradients of variables registered with register_local_var
        stay on their rank, divided by the set's size (unless False).
    device_dense, device_sparse: accepted; tensors are staged through host memory.
    """

    def __init__(self, optimizer, name=None, device_dense='', device_sparse='',
                 compression=Compression.none, sparse_as_dense=False,
                 gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                 average_aggregated_gradients=False, num_groups=0, groups=None,
                 process_set=PS, scale_local_gradients=True):
        if isinstance(optimizer, dict):  # from_config
            optimizer = keras.optimizers.deserialize(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise UsageError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                             f"{type(optimizer).__name__}")
        if isinstance(compression, str):  # from_config
            compression = _COMPRESSIONS[compression]
        if isinstance(backward_passes_per_step, bool) or \
                not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise UsageError(f"DistributedOptimizer: backward_passes_per_step must be an int "
                             f"of at least 1, got {backward_passes_per_step!r}")
        if average_aggregated_gradients and ReduceOp(op) == ReduceOp.ADASUM:
            raise UsageError("DistributedOptimizer: average_aggregated_gradients does not "
                             "apply to op=Adasum")
        # The base class needs a learning rate; the wrapped optimizer's is the one used.
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self._inner = optimizer
        self._reducer = GradientReducer(compression, op, gradient_predivide_factor,
                                        sparse_as_dense, num_groups, groups, process_set,
                                        scale_local_gradients, "keras.DistributedOptimizer")
        self._passes = backward_passes_per_step
        self._average_aggregated = bool(average_aggregated_gradients)
        self._accumulators = None
        # Tensor names must agree across ranks; Keras's auto-names (sgd, sgd_1, ...) count
        # every optimizer the process made, so count only these wrappers instead.
        self._reduce_name = f"keras.opt{next(_instances)}.grads"

    @property
    def _compression(self):
        return self._reducer.compression

    def register_local_var(self, var):
        """var's gradient stays on this rank (model parallelism for that variable)."""
        self._reducer.register_local(var)

    # ---- the wrapped optimizer's state, exposed as ours ----

    @property
    def inner_optimizer(self):
        return self._inner

    @property
    def learning_rate(self):
        return self._inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if hasattr(self, "_inner"):
            self._inner.learning_rate = value
        else:  # during the base class's __init__
            keras.optimizers.Optimizer.learning_rate.fset(self, value)

    @property
    def iterations(self):
        return self._inner.iterations

    @property
    def variables(self):
        return self._inner.variables

    def build(self, var_list):
        self._inner.build(var_list)
        if self._passes > 1 and self._accumulators is None:
            self._accumulators = [tf.Variable(tf.zeros_like(v), trainable=False,
                                              name=f"ringsync_accumulator_{i}")
                                  for i, v in enumerate(var_list)]
            self._pass_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="ringsync_pass_count")
        self.built = True

    def save_own_variables(self, store):
        self._inner.save_own_variables(store)

    def load_own_variables(self, store):
        self._inner.load_own_variables(store)

    def get_config(self):
        r = self._reducer
        return {"optimizer": keras.optimizers.serialize(self._inner), "name": self.name,
                "compression": _compression_name(self._compression),
                "sparse_as_dense": r.sparse_as_dense, "gradient_predivide_factor": r.predivide,
                "op": int(r.op), "backward_passes_per_step": self._passes,
                "average_aggregated_gradients": self._average_aggregated,
                "groups": r.groups if isinstance(r.groups, int) else None,
                "scale_local_gradients": r.scale_local}
        # (process_set, variable groups and local variables are live objects: left out)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if config.get("compression") == "custom":
            config["compression"] = Compression.none
        return cls(**config)

    # ---- applying ----

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*list(grads_and_vars))
        return self.apply(list(grads), list(variables))

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables) if trainable_variables is not None else None
        if not self._inner.built:
            self.build(variables)
        if self._passes == 1:
            return self._inner.apply(self._reduce(list(grads), variables), variables)
        return self._accumulate_then_apply(list(grads), variables)

    def _reduce(self, grads, variables):
        return self._reducer.reduce(grads, variables, self._reduce_name)

    def _accumulate_then_apply(self, grads, variables):
        """Sum gradients locally for backward_passes_per_step calls, then reduce (the sum,
        or its mean with average_aggregated_gradients) and apply once; the other calls
        change no weight."""
        if self._accumulators is None:
            self.build(variables)
        for acc, g in zip(self._accumulators, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        self._pass_count.assign_add(1)

        def reduce_and_apply():
            summed = [tf.identity(a) for a in self._accumulators]
            if self._average_aggregated:
                summed = [s / tf.cast(self._passes, s.dtype) for s in summed]
            self._inner.apply(self._reduce(summed, variables), variables)
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        return tf.cond(self._pass_count % self._passes == 0, reduce_and_apply,
                       lambda: tf.constant(False))


# Its public name and home, where Keras's saved configs and pickle look it up (the class
# is defined here so that DistributedOptimizer above reaches it without importing
# ringsync.tensorflow.keras, which imports this module).
KerasDistributedOptimizer.__module__ = "ringsync.tensorflow.keras"
KerasDistributedOptimizer.__name__ = KerasDistributedOptimizer.__qualname__ = "DistributedOptimizer"
