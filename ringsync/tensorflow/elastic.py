"""Elastic training with TensorFlow / Keras 3: TensorFlowKerasState (see ringsync.elastic).

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...   # steps with DistributedGradientTape or the Keras DistributedOptimizer
        state.commit()
"""
from ringsync.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                              run)  # (the module's API)

from . import broadcast_variables


class TensorFlowKerasState(ObjectState):
    """A built Keras model's variables, its optimizer's variables (slots, iteration
    count; built here if the optimizer has not been yet, so that a replacement rank has
    the same variables as the survivors), and any keyword values."""

    def __init__(self, model, optimizer=None, **kwargs):
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
