"""Elastic training with Keras 3 (horovod.tensorflow.keras.elastic): the state of a model
and its optimizer, and run() (see ringsync.elastic)."""
from ringsync.tensorflow.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                                         TensorFlowKerasState, run)

KerasState = TensorFlowKerasState  # (Horovod's name for it in this module)
