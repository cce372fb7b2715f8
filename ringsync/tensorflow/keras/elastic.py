"""Elastic training with Keras 3 (horovod.tensorflow.keras.elastic): the state of a model
and its optimizer, callbacks that keep it current during fit(), and run().

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, steps_per_epoch=..., epochs=epochs - state.epoch, callbacks=callbacks)

A lost rank interrupts fit(); run() rolls every survivor back to the last commit and calls
train(state) again, which goes on from state.epoch and state.batch."""
import keras

from ringsync.tensorflow.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                                         TensorFlowKerasState, run)


def KerasState(model, optimizer=None, **kwargs):  # noqa: N802 (Horovod's name)
    """TensorFlowKerasState(model, optimizer, **kwargs): kwargs (batch=0, epoch=0, ...)
    are kept, committed and restored with the weights."""
    return TensorFlowKerasState(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """state.commit() every batches_per_commit batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be at least 1, "
                             f"got {batches_per_commit}")
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """state.batch: the batches of the current epoch done (0 at its end). After a reset,
    the first epoch runs only the batches that were left."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.steps_per_epoch = None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """state.epoch: the epochs done, counted from the state's epoch when fit() started
    (so fit(epochs=total - state.epoch) after a reset ends where the job should)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
