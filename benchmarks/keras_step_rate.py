"""Keras model.fit step rate: ringsync's DistributedOptimizer against
tf.distribute.MultiWorkerMirroredStrategy, same ranks, same per-rank batch, one job.

    mpirun -np 2 python benchmarks/keras_step_rate.py [--steps 60] [--batch 32]

With --mwms, MultiWorkerMirroredStrategy is set up first (it must come before TensorFlow
runs anything) and measured too. On this project's reference machine (TensorFlow 2.21,
Keras 3.15, CPU) Keras's fit() under that strategy fails at its first step ("Attempt to
convert a value (PerReplica...)"), with arrays and with datasets alike, and the rank that
fails leaves its peers waiting in the strategy's collectives; so it is opt-in. Without it,
ringsync is compared with one process training on the same per-rank batch. A benchmark,
not a test.
"""
import argparse
import json
import os
import socket
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mwms", action="store_true", help="also try MultiWorkerMirroredStrategy")
    return p.parse_args()


def build_model(keras, width, layers):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,))] +
                             [keras.layers.Dense(width, activation="relu") for _ in range(layers)] +
                             [keras.layers.Dense(10)])
    return model


def data(np, rows, width):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, width)).astype("float32"),
            rng.integers(0, 10, size=rows).astype("int64"))


def timed_fit(model, x, y, batch, steps):
    """Seconds per step of model.fit after a warm-up epoch (tracing). Datasets, not
    arrays: Keras 3 feeds arrays to MultiWorkerMirroredStrategy as PerReplica values that
    its train step cannot take."""
    import tensorflow as tf

    def dataset(n):
        return tf.data.Dataset.from_tensor_slices((x[: batch * n], y[: batch * n])).batch(batch)

    model.fit(dataset(5), epochs=1, verbose=0)
    start = time.perf_counter()
    model.fit(dataset(steps), epochs=1, verbose=0)
    return (time.perf_counter() - start) / steps


def single_process_time(comm, keras, loss, x, y, args):
    """Rank 0 alone, the others asleep (an MPI barrier would spin and take a core)."""
    result = None
    if comm.rank == 0:
        model = build_model(keras, args.width, args.layers)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
        result = timed_fit(model, x, y, args.batch, args.steps)
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)
    return comm.bcast(result, root=0)


def main():
    args = parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    if args.mwms:
        ports = comm.allgather(free_port())
        os.environ["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": rank}})
    import numpy as np
    import tensorflow as tf
    import keras
    x, y = data(np, args.batch * size * (args.steps + 5), args.width)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mwms, mwms_error = None, "not tried (pass --mwms)"
    if args.mwms:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        try:
            with strategy.scope():
                mwms_model = build_model(keras, args.width, args.layers)
                mwms_model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
            # MWMS shards a global batch of batch * size itself.
            mwms, mwms_error = timed_fit(mwms_model, x, y, args.batch * size, args.steps), None
        except Exception as e:  # say why, and measure the rest
            mwms_error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    single = single_process_time(comm, keras, loss, x, y, args)

    import ringsync.tensorflow.keras as hvd
    hvd.init()
    model = build_model(keras, args.width, args.layers)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=loss)
    mine = slice(rank, None, size)
    ringsync_time = timed_fit(model, x[mine], y[mine], args.batch, args.steps)
    times = comm.gather((mwms, ringsync_time), root=0)
    if rank == 0:
        ours = max(t[1] for t in times)
        print(f"model.fit, {size} ranks, {args.layers} x Dense({args.width}), batch {args.batch} "
              f"per rank, {args.steps} steps")
        print(f"  ringsync DistributedOptimizer: {1 / ours:7.1f} steps/s")
        print(f"  one process, same per-rank batch: {1 / single:7.1f} steps/s "
              f"(ringsync step = {ours / single:.2f} x)")
        if mwms_error:
            print(f"  MultiWorkerMirroredStrategy: {mwms_error}")
        else:
            mwms = max(t[0] for t in times)
            print(f"  MultiWorkerMirroredStrategy: {1 / mwms:7.1f} steps/s")
            print(f"  ratio ringsync/MWMS: {mwms / ours:.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
