"""Keras model.fit step rate: ringsync's DistributedOptimizer against
tf.distribute.MultiWorkerMirroredStrategy, same ranks, same per-rank batch, one job.

    mpirun -np 2 python benchmarks/keras_step_rate.py [--steps 200] [--batch 32]

With --mwms, MultiWorkerMirroredStrategy is set up first (it must come before TensorFlow
runs anything) and measured too. On this project's reference machine (TensorFlow 2.21,
Keras 3.15, CPU) Keras's fit() under that strategy fails at its first step ("Attempt to
convert a value (PerReplica...)"), with arrays and with datasets alike, and the rank that
fails leaves its peers waiting in the strategy's collectives; so it is opt-in. Without it,
ringsync is compared with one process training on the same per-rank batch. A benchmark,
not a test.

A second table puts the cost in milliseconds per step: the one-process step, ringsync's
step, its overhead (the difference), their ratio, the no-communication step (every rank
training alone at the same time: what sharing the host costs, no reduction), and the
copy-and-reduce bound of the step's gradient bytes measured in the same run (every rank at
once copies its gradients into one buffer and allreduces it with ringsync, as one buffer),
with the overhead over that bound. Each setup is timed --rounds times, alternating, and its
fastest round counts (timings on a shared host vary by 2x between rounds). Each rank
computes on one TensorFlow thread (--threads), as each rank of torch_step_rate.py does.
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
    p.add_argument("--steps", type=int, default=200,
                   help="steps per fit; a fit also pays a fixed cost at its end (TensorFlow "
                        "finishing queued steps), which shorter fits spread over fewer steps")
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="timings per setup; the best counts")
    p.add_argument("--mwms", action="store_true", help="also try MultiWorkerMirroredStrategy")
    p.add_argument("--threads", type=int, default=1,
                   help="TensorFlow intra-op threads per rank (default 1: ranks share cores)")
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


def dataset(x, y, batch, steps):
    """Datasets, not arrays: Keras 3 feeds arrays to MultiWorkerMirroredStrategy as
    PerReplica values that its train step cannot take."""
    import tensorflow as tf
    return tf.data.Dataset.from_tensor_slices((x[: batch * steps], y[: batch * steps])).batch(
        batch)


def warm_up(model, x, y, batch):
    model.fit(dataset(x, y, batch, 5), epochs=1, verbose=0)  # (traces the train step)


def timed_fit(model, x, y, batch, steps):
    """Seconds per step of model.fit (warmed up)."""
    data = dataset(x, y, batch, steps)
    start = time.perf_counter()
    model.fit(data, epochs=1, verbose=0)
    return (time.perf_counter() - start) / steps


def sleep_until_all_arrive(comm):
    """An MPI barrier would spin and take a core from the rank that is timing alone."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def together(comm, fit):
    """fit() on every rank at once; the slowest rank's seconds per step."""
    from mpi4py import MPI
    comm.Barrier()
    return comm.allreduce(fit(), op=MPI.MAX)


def alone(comm, fit):
    """fit() on rank 0 alone, the others asleep."""
    seconds = fit() if comm.rank == 0 else None
    sleep_until_all_arrive(comm)
    return comm.bcast(seconds, root=0)


def copy_and_reduce_seconds(comm, shapes, repeat=20):
    """The bound: every rank at once copies gradients of these shapes (float32) into one
    buffer and allreduces it with ringsync (median of repeat)."""
    import numpy as np
    import ringsync
    from mpi4py import MPI
    grads = [np.random.default_rng(comm.rank).random(s, dtype=np.float32) for s in shapes]
    flat = np.empty(sum(g.size for g in grads), np.float32)
    times = []
    for _ in range(repeat + 2):
        comm.Barrier()
        start = time.perf_counter()
        np.concatenate([g.reshape(-1) for g in grads], out=flat)
        ringsync.allreduce_(flat, name="bench.bound")
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return sorted(times[2:])[repeat // 2]


def print_tables(comm, args, ms, grad_bytes, mwms_line):
    size = comm.size
    print(f"model.fit, {size} ranks, {args.layers} x Dense({args.width}), batch {args.batch} "
          f"per rank, {args.steps} steps, best of {args.rounds} rounds")
    print(f"  ringsync DistributedOptimizer: {1e3 / ms['ringsync']:7.1f} steps/s")
    print(f"  one process, same per-rank batch: {1e3 / ms['single']:7.1f} steps/s "
          f"(ringsync step = {ms['ringsync'] / ms['single']:.2f} x)")
    print(mwms_line)
    print()
    header = (f"{'grad MB':>7} {'1-process ms':>12} {'ringsync ms':>11} {'overhead ms':>11} "
              f"{'ringsync/1-process':>18} {'no-comm ms':>10} {'bound ms':>8} "
              f"{'overhead/bound':>14}")
    print(header)
    print("-" * len(header))
    overhead = ms["ringsync"] - ms["single"]
    print(f"{grad_bytes / 1e6:>7.1f} {ms['single']:>12.2f} {ms['ringsync']:>11.2f} "
          f"{overhead:>11.2f} {ms['ringsync'] / ms['single']:>18.2f} {ms['together']:>10.2f} "
          f"{ms['bound']:>8.2f} {overhead / ms['bound']:>14.2f}")
    print("(overhead: ringsync's step minus the one-process step; no-comm: every rank training "
          "alone at once;\n bound: copy the step's gradient bytes into one buffer and allreduce "
          "it with ringsync, every rank at once; goal: ringsync/1-process <= 1.3)", flush=True)


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
    # One compute thread per rank, as torch_step_rate.py does: the ranks share the host's
    # cores (with TensorFlow's default pool, the one-process baseline would use every core
    # while each rank of the job competes for them).
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
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
            warm_up(mwms_model, x, y, args.batch * size)
            mwms, mwms_error = timed_fit(mwms_model, x, y, args.batch * size, args.steps), None
        except Exception as e:  # say why, and measure the rest
            mwms_error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

    import ringsync.tensorflow.keras as hvd
    hvd.init()
    plain = build_model(keras, args.width, args.layers)
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    model = build_model(keras, args.width, args.layers)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=loss)
    mine = slice(rank, None, size)
    xm, ym = x[mine], y[mine]
    warm_up(plain, x, y, args.batch)
    warm_up(model, xm, ym, args.batch)
    seconds = {"single": [], "ringsync": [], "together": []}
    for _ in range(args.rounds):
        seconds["single"].append(alone(comm, lambda: timed_fit(plain, x, y, args.batch,
                                                                  args.steps)))
        seconds["ringsync"].append(together(comm, lambda: timed_fit(model, xm, ym, args.batch,
                                                                       args.steps)))
        seconds["together"].append(together(comm, lambda: timed_fit(plain, x, y, args.batch,
                                                                       args.steps)))
    ms = {k: 1e3 * min(v) for k, v in seconds.items()}
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    grad_bytes = 4 * sum(int(np.prod(s)) for s in shapes)
    ms["bound"] = 1e3 * copy_and_reduce_seconds(comm, shapes)
    times = comm.gather(mwms, root=0)
    if rank == 0:
        mwms_line = f"  MultiWorkerMirroredStrategy: {mwms_error}" if mwms_error else \
            (f"  MultiWorkerMirroredStrategy: {1 / max(times):7.1f} steps/s (ratio "
             f"ringsync/MWMS: {max(times) * 1e3 / ms['ringsync']:.2f})")
        print_tables(comm, args, ms, grad_bytes, mwms_line)
    hvd.shutdown()


if __name__ == "__main__":
    main()
