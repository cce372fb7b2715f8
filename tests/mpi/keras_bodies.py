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


def fit_matches_one_process(dtype="float32", passes="1", jit="0", average="0"):
    """average: average_aggregated_gradients (the k passes' gradients averaged, not summed)."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    passes, jit, average = int(passes), jit == "1", average == "1"
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
            if average:
                grads_sum = [g / passes for g in grads_sum]
            ref_opt.apply_gradients(zip(grads_sum, reference.trainable_variables))
    model = _model(dtype, jit, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                        backward_passes_per_step=passes,
                                                        average_aggregated_gradients=average))
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


def horovod_keras_api():
    """horovod.tensorflow.keras as Horovod users call it: the callbacks module, the
    optimizer's arguments (honoured or refused), PartialDistributedOptimizer, momentum
    correction, load_model, the value collectives, BestModelCheckpoint."""
    import ringsync.keras as hvd_alias
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    assert hvd_alias is hvd and hvd.callbacks.MetricAverageCallback is hvd.MetricAverageCallback
    x, y = _data("float32")
    part = slice(me * 16, (me + 1) * 16)
    # Every argument is honoured or refused, never dropped.
    sgd = keras.optimizers.SGD(0.1)
    for bad, kind in (({"no_such_argument": 1}, TypeError), ({"op": hvd.Max}, ValueError),
                      ({"backward_passes_per_step": 0}, ValueError),
                      ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, ValueError),
                      ({"groups": -1}, ValueError)):
        try:
            hvd.DistributedOptimizer(sgd, **bad)
        except kind:
            pass
        else:
            raise AssertionError(f"DistributedOptimizer accepted {bad}")
    opt = hvd.DistributedOptimizer(sgd, None, '', '', hvd.Compression.fp16, False, 1.0,
                                   hvd.Average, 2, True, 0, 2)
    config = opt.get_config()
    again = hvd.DistributedOptimizer.from_config(config)
    redone = again.get_config()
    assert {k: v for k, v in redone.items() if k != "optimizer"} == \
        {k: v for k, v in config.items() if k != "optimizer"}, (redone, config)
    assert isinstance(again.inner_optimizer, keras.optimizers.SGD)
    assert config["compression"] == "fp16" and config["groups"] == 2, config
    assert config["backward_passes_per_step"] == 2 and config["average_aggregated_gradients"]
    # PartialDistributedOptimizer: the local layer's weights stay each rank's own.
    keras.utils.set_random_seed(1)
    local = keras.layers.Dense(1, name="local")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), local])
    model.compile(optimizer=hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                            local_layers=[local]), loss="mse")
    model.fit(x[part], y[part] * (me + 1), batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    shared, own = model.layers[0].get_weights()[0], local.get_weights()[0]
    assert np.array_equal(hvd.broadcast_object(shared, 0), shared), "shared layer differs"
    if size > 1:
        assert not np.array_equal(hvd.broadcast_object(own, 0), own) or me == 0, \
            "the local layer was averaged"
    # BroadcastGlobalVariablesCallback(root_rank, device, local_variables)
    keras.utils.set_random_seed(10 + me)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    kept = model.layers[1].kernel
    before = kept.numpy().copy()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    model.fit(x[part], y[part], batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, '', [kept])])
    assert np.array_equal(kept.numpy(), before), "a local variable was broadcast"
    first = model.layers[0].kernel.numpy()
    assert np.array_equal(hvd.broadcast_object(first, 0), first)
    # Schedule with a number as multiplier: initial_lr * 0.5 ** (epoch - start_epoch), and
    # momentum correction: the velocity is scaled with the learning rate.
    seen, velocity = [], {}
    model = _model("float32", optimizer=hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.2, momentum=0.9)))

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate))
            if batch == 0:
                velocity[len(seen)] = [v.numpy().copy() for v in
                                       getattr(self.model.optimizer.inner_optimizer, "momentums", [])]

        def on_epoch_end(self, epoch, logs=None):
            velocity[("end", epoch)] = [v.numpy().copy() for v in
                                        getattr(self.model.optimizer.inner_optimizer, "momentums", [])]

    schedule = hvd.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1,
                                                          momentum_correction=True)
    history = model.fit(x[part], y[part], batch_size=4, epochs=3, verbose=0, shuffle=False,
                        callbacks=[schedule, Record()])
    assert np.allclose(seen, [0.2] * 4 + [0.2] * 4 + [0.1] * 4), seen
    assert np.allclose(history.history["lr"], [0.2, 0.2, 0.1])
    for a, b in zip(velocity[("end", 1)], velocity[9]):  # lr halved before batch 0 of epoch 2
        assert np.allclose(b, a * 0.5), (a, b)
    for a, b in zip(velocity[("end", 0)], velocity[5]):  # unchanged at epoch 1
        assert np.allclose(b, a), (a, b)
    # Warmup's positional order: (initial_lr, warmup_epochs, momentum_correction, ...)
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.4, 2, False, 4)
    assert warmup.momentum_correction is False and warmup.steps_per_epoch == 4
    # Collectives on values (the global set; tensors back, as Horovod's eager ones)
    got = hvd.allreduce(np.array([me, 1.0]), name="keras.value")
    assert np.allclose(got.numpy(), [(size - 1) / 2, 1.0])
    assert list(hvd.allgather([me]).numpy()) == list(range(size))
    assert float(hvd.broadcast(float(me), size - 1)) == size - 1
    assert np.allclose(hvd.reducescatter(np.ones((size, 2)) * me, op=hvd.Sum).numpy(),
                       np.full((1, 2), sum(range(size))))
    try:
        hvd.broadcast_global_variables(0)
    except RuntimeError as e:
        assert "BroadcastGlobalVariablesCallback" in str(e)
    else:
        raise AssertionError("broadcast_global_variables passed silently")
    # load_model: a model saved by one process with a plain optimizer comes back wrapped.
    folder = os.environ["RINGSYNC_TEST_DIR"]
    path = os.path.join(folder, f"plain-{me}.keras")
    plain = _model("float32", optimizer=keras.optimizers.Adam(0.01))
    plain.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0)
    plain.save(path)
    loaded = hvd.load_model(path, compression=hvd.Compression.fp16)
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer)
    assert loaded.optimizer._compression is hvd.Compression.fp16
    assert int(loaded.optimizer.iterations) == int(plain.optimizer.iterations)
    loaded.fit(x[part], y[part], batch_size=4, epochs=1, verbose=0,
               callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    for w in loaded.get_weights():
        assert np.array_equal(hvd.broadcast_object(w, 0), w)
    # BestModelCheckpoint: filepath set later, as Horovod's estimators do.
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    best.filepath = os.path.join(folder, f"best-{me}.keras")
    loaded.fit(x[part], y[part], batch_size=4, epochs=2, verbose=0,
               callbacks=[hvd.callbacks.MetricAverageCallback(), best])
    assert os.path.exists(best.filepath)
    hvd.shutdown()
