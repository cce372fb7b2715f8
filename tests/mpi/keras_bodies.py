"""Keras 3 bodies, run on every rank under mpirun: model.fit with DistributedOptimizer
against one process on the whole batch, callbacks, saving and loading."""
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ringsync.tensorflow.keras as hvd  # noqa: E402

GLOBAL_BATCH = 16


def _data(dtype):
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 5)).astype(dtype), rng.normal(size=(64, 1)).astype(dtype)


def _model(dtype, jit_compile=False, optimizer=None):
    keras.utils.set_random_seed(1)  # the same start on every rank and in the reference
    keras.backend.set_floatx(dtype)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1, momentum=0.9), loss="mse",
                  jit_compile=jit_compile)
    return model


def _my_shards(n_samples, me, size):
    """Rank r's i-th batch is the r-th slice of the global i-th batch."""
    per = GLOBAL_BATCH // size
    return np.concatenate([np.arange(i, i + GLOBAL_BATCH)[me * per:(me + 1) * per]
                           for i in range(0, n_samples, GLOBAL_BATCH)])


def fit_matches_one_process(dtype="float32", passes="1", jit="0"):
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    passes, jit = int(passes), jit == "1"
    x, y = _data(dtype)
    reference = _model(dtype)
    # With k backward passes per step, the reference steps once per k micro-batches.
    ref_opt = reference.optimizer
    for _ in range(2):
        for i in range(0, 64, GLOBAL_BATCH * passes):
            grads_sum = None
            for j in range(passes):
                xb = x[i + j * GLOBAL_BATCH: i + (j + 1) * GLOBAL_BATCH]
                yb = y[i + j * GLOBAL_BATCH: i + (j + 1) * GLOBAL_BATCH]
                import tensorflow as tf
                with tf.GradientTape() as tape:
                    loss = keras.losses.mean_squared_error(yb, reference(xb))
                    loss = tf.reduce_mean(loss)
                grads = tape.gradient(loss, reference.trainable_variables)
                grads_sum = grads if grads_sum is None else [a + b for a, b in zip(grads_sum, grads)]
            ref_opt.apply_gradients(zip(grads_sum, reference.trainable_variables))
    model = _model(dtype, jit, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                        backward_passes_per_step=passes))
    idx = _my_shards(64, me, size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x[idx], y[idx], batch_size=GLOBAL_BATCH // size, epochs=2, shuffle=False,
                  verbose=0, callbacks=[hvd.BroadcastGlobalVariablesCallback(0)])
    if jit:
        assert any("XLA cannot compile" in str(w.message) for w in caught), caught
        assert model.jit_compile is False
    rtol = {"float64": 1e-10, "float32": 1e-5}[dtype]
    for a, b in zip(model.get_weights(), reference.get_weights()):
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err < rtol, f"{dtype} passes={passes} jit={jit}: off by {err:.2e}"
    keras.backend.set_floatx("float32")
    hvd.shutdown()


def callbacks_do_what_their_names_say():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    x, y = _data("float32")
    keras.utils.set_random_seed(100 + me)  # ranks start different
    if me == 0:  # Keras's own optimizer names now differ by rank: ringsync's must not
        keras.optimizers.SGD(0.1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    steps_per_epoch = 4
    warmup = hvd.LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2,
                                            steps_per_epoch=steps_per_epoch)
    seen = []

    class RecordLR(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate))

    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.4)), loss="mse")
    part = slice(me * 16, (me + 1) * 16)
    history = model.fit(x[part], y[part], batch_size=4, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd.BroadcastGlobalVariablesCallback(0),
                                   hvd.MetricAverageCallback(), warmup, RecordLR()])
    # Broadcast: identical weights everywhere.
    for w in model.get_weights():
        assert np.array_equal(hvd.broadcast_object(w, 0), w)
    # Metric average: the same loss history on every rank.
    assert hvd.allgather_object(history.history["loss"]) == [history.history["loss"]] * size
    # Warmup: lr = 0.4/size * (epoch*(size-1)/2 + 1), epoch counting the batch being started,
    # so the last warmup batch runs at 0.4 exactly; then 0.4 stays.
    for step, lr in enumerate(seen[: 2 * steps_per_epoch]):
        epoch = (step + 1) / steps_per_epoch
        assert np.isclose(lr, 0.4 / size * (epoch * (size - 1) / 2 + 1), rtol=1e-6), (step, lr)
    assert np.isclose(seen[2 * steps_per_epoch - 1], 0.4) and np.isclose(seen[-1], 0.4), seen
    # Schedule, staircase: lr = 1.0 * 0.5 ** epoch from epoch 1 on.
    seen.clear()
    schedule = hvd.LearningRateScheduleCallback(1.0, lambda e: 0.5 ** e, start_epoch=1)
    model.fit(x[part], y[part], batch_size=4, epochs=3, shuffle=False, verbose=0,
              callbacks=[schedule, RecordLR()])
    assert np.isclose(seen[steps_per_epoch], 0.5) and np.isclose(seen[-1], 0.25), seen
    hvd.shutdown()


def save_and_load_a_wrapped_model():
    hvd.init()
    me = hvd.rank()
    x, y = _data("float32")
    model = _model("float32", optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)))
    model.fit(x[me::hvd.size()], y[me::hvd.size()], batch_size=8, epochs=1, verbose=0,
              callbacks=[hvd.BroadcastGlobalVariablesCallback(0)])
    path = os.path.join(os.environ["RINGSYNC_TEST_DIR"], f"model-{me}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    assert isinstance(loaded.optimizer.inner_optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        assert np.array_equal(np.asarray(a), np.asarray(b)), a.name
    loaded.fit(x[me::hvd.size()], y[me::hvd.size()], batch_size=8, epochs=1, verbose=0)
    for w in loaded.get_weights():  # training the loaded model keeps ranks in step
        assert np.array_equal(hvd.broadcast_object(w, 0), w)
    hvd.shutdown()
