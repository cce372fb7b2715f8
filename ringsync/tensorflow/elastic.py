"""Elastic training with TensorFlow / Keras 3: TensorFlowKerasState (see ringsync.elastic).

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...   # steps with DistributedGradientTape or the Keras DistributedOptimizer
        state.commit()
"""
from ringsync.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                              run)  # (the module's API)
from ringsync.errors import HorovodInternalError  # noqa: F401

from .functions import broadcast_variables


class TensorFlowKerasState(ObjectState):
    """A built Keras model's variables, its optimizer's variables (slots, iteration
    count; built here if the optimizer has not been yet, so that a replacement rank has
    the same variables as the survivors), and any keyword values."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        """backend: accepted for Horovod's signature (Keras 3 has one)."""
        if not model.built:
            raise ValueError("TensorFlowKerasState: the model must be built (call it on a "
                             "batch, or give it an Input) before its state is kept")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _optimizer_variables(self):
        if self.optimizer is None:
            return []
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)
        return list(self.optimizer.variables)

    def _variables(self):
        return list(self.model.variables) + self._optimizer_variables()

    def snapshot(self):
        return {"variables": [v.numpy() for v in self._variables()],
                "objects": super().snapshot()}

    def load_snapshot(self, snapshot) -> None:
        for variable, value in zip(self._variables(), snapshot["variables"]):
            variable.assign(value)
        super().load_snapshot(snapshot["objects"])

    def broadcast_state(self, root_rank: int) -> None:
        broadcast_variables(self._variables(), root_rank)
        super().broadcast_state(root_rank)


class TensorFlowState(ObjectState):
    """A list of tf.Variables (TensorFlow 2 has no global collection to default to) and
    any keyword values. session: TensorFlow 1's, accepted for Horovod's signature."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlowState: give the variables to keep (TensorFlow 2 has "
                             "no global variables collection)")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def snapshot(self):
        return {"variables": [v.numpy() for v in self.variables], "objects": super().snapshot()}

    def load_snapshot(self, snapshot) -> None:
        for variable, value in zip(self.variables, snapshot["variables"]):
            variable.assign(value)
        super().load_snapshot(snapshot["objects"])

    def broadcast_state(self, root_rank: int) -> None:
        broadcast_variables(self.variables, root_rank)
        super().broadcast_state(root_rank)
