"""Jitted JAX training steps: ringsync.jax's DistributedOptimizer against JAX's own
multi-process CPU collectives (gloo), in one mpirun job.

    mpirun -np 2 python benchmarks/jax_step_rate.py
    mpirun -np 2 python benchmarks/jax_step_rate.py --models digits-mlp --steps 20

Every rank runs, on the same models, per-rank batches and starting parameters, taking
turns (each round in a new order):
- one process: the jitted step with no communication (the compute the step cannot avoid);
- ringsync: the same step with hvd.DistributedOptimizer (optax Adam), its gradients
  reduced by the core's XLA custom call, one per dtype;
- ringsync, callbacks: the same through ordered io_callbacks into Python (what the
  custom call saves);
- JAX gloo: jax.distributed.initialize with the gloo CPU collectives, the step a
  shard_map over the processes' devices averaging the gradients with lax.pmean.
Printed on rank 0: each step's median time, each overhead (step minus one process's),
the copy-and-reduce bound of the step's gradient bytes (every rank at once copies them
into a buffer, adds a buffer of that size and copies the sum back: what any data-parallel
step must at least do on one host), and the ratios the goals name.
"""
import argparse
import os
import socket
import statistics
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD


def start_jax_distributed():
    """JAX's own multi-process runtime over this mpirun job's ranks (before any JAX work)."""
    port = None
    if COMM.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = COMM.bcast(port, root=0)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=COMM.size, process_id=COMM.rank)


start_jax_distributed()

import ringsync.jax as hvd  # noqa: E402
from ringsync.jax import _xla  # noqa: E402  (to time the io_callback path beside it)


# ---- models: lists of (in, out) dense layers, and their loss ----

MODELS = {
    "many-small": [(256, 256)] * 40,       # 80 small tensors (fusion matters)
    "few-large": [(2048, 2048)] * 3,       # 6 tensors, 50 MB of gradients
    "digits-mlp": [(64, 64), (64, 10)],    # the example's shape
}


def init_params(layers, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(layers))
    return [{"w": jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i),
             "b": jnp.zeros(o, jnp.float32)} for k, (i, o) in zip(keys, layers)]


def loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    out = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


def batch(layers, rows, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, layers[0][0])).astype(np.float32),
            rng.standard_normal((rows, layers[-1][1])).astype(np.float32))


def local_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        updates, opt_state = tx.update(jax.grad(loss)(params, x, y), opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


# ---- the setups: each (step, state) with the same starting point ----

def one_process(layers, x, y):
    tx = optax.adam(1e-3)
    params = init_params(layers, 0)
    return local_step(tx), [params, tx.init(params), x, y]


def ringsync_setup(layers, x, y, ffi):
    _xla.ENABLED = ffi and _xla.FFI_AVAILABLE
    tx = hvd.DistributedOptimizer(optax.adam(1e-3))
    params = init_params(layers, 0)
    step = local_step(tx)
    state = [params, tx.init(params), x, y]
    jax.block_until_ready(step(*state))  # traced and compiled now, on the path chosen
    return step, state


def jax_gloo_setup(layers, x, y):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tx = optax.adam(1e-3)

    def per_device(params, opt_state, x, y):
        grads = jax.lax.pmean(jax.grad(loss)(params, x, y), "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def global_array(value, sharding):
        return jax.make_array_from_process_local_data(sharding, np.asarray(value))

    params = jax.tree.map(lambda v: global_array(v, replicated), init_params(layers, 0))
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
    step = jax.jit(jax.shard_map(per_device, mesh=mesh,
                                 in_specs=(P(), P(), P("data"), P("data")),
                                 out_specs=(P(), P())))
    return step, [params, opt_state, global_array(x, split), global_array(y, split)]


def timed_steps(step, state, steps):
    """Median seconds per step of `steps` steps (the slowest rank's), after a warm-up."""
    params, opt_state, x, y = state
    params, opt_state = jax.block_until_ready(step(params, opt_state, x, y))
    times = []
    for _ in range(steps):
        COMM.Barrier()
        start = time.perf_counter()
        params, opt_state = jax.block_until_ready(step(params, opt_state, x, y))
        times.append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(times)


def copy_and_reduce_seconds(nbytes, repeat=20):
    grads = np.random.rand(nbytes // 4).astype(np.float32)
    fused, peer = np.empty_like(grads), np.random.rand(nbytes // 4).astype(np.float32)
    times = []
    for _ in range(repeat + 2):
        COMM.Barrier()
        start = time.perf_counter()
        np.copyto(fused, grads)
        np.add(fused, peer, out=fused)
        np.copyto(grads, fused)
        times.append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return sorted(times[2:])[repeat // 2]


# ---- the run ----

SETUPS = ["one process", "ringsync", "ringsync, callbacks", "JAX gloo"]


# JAX 0.10's io_callback has hung here converting a 48 MiB operand to numpy (inside the
# callback, before ringsync is called; on one rank too): the callback path is timed only
# below this size.
CALLBACK_LIMIT_BYTES = 16 << 20


def measure(name, args):
    layers = MODELS[name]
    x, y = batch(layers, args.batch, 1 + COMM.rank)
    nbytes = sum(4 * (i * o + o) for i, o in layers)
    makers = {"one process": lambda: one_process(layers, x, y),
              "ringsync": lambda: ringsync_setup(layers, x, y, True),
              "ringsync, callbacks": lambda: ringsync_setup(layers, x, y, False),
              "JAX gloo": lambda: jax_gloo_setup(layers, x, y)}
    setups = [s for s in SETUPS
              if s != "ringsync, callbacks" or nbytes < CALLBACK_LIMIT_BYTES]
    built = {setup: makers[setup]() for setup in setups}
    samples = {setup: [] for setup in setups}
    for r in range(args.rounds):
        for setup in setups[r % len(setups):] + setups[:r % len(setups)]:
            samples[setup].append(timed_steps(*built[setup], args.steps))
    return ({setup: statistics.median(t) for setup, t in samples.items()},
            copy_and_reduce_seconds(nbytes), nbytes)


def report(name, times, bound, nbytes):
    alone = times["one process"]
    over = {s: times[s] - alone for s in SETUPS[1:] if s in times}
    print(f"\n{name}: {nbytes / 2**20:.1f} MiB of float32 gradients; copy-and-reduce bound "
          f"{bound * 1e3:.3f} ms")
    print(f"  {'':22s} {'step ms':>9s} {'overhead ms':>12s}")
    for setup in SETUPS:
        if setup not in times:
            print(f"  {setup:22s} (not timed: see CALLBACK_LIMIT_BYTES)")
            continue
        extra = f"{over[setup] * 1e3:12.3f}" if setup in over else f"{'':12s}"
        print(f"  {setup:22s} {times[setup] * 1e3:9.3f} {extra}")
    ours = over["ringsync"]
    callbacks = (f"; callbacks' overhead / the custom call's: "
                 f"{over['ringsync, callbacks'] / ours:.2f}" if "ringsync, callbacks" in over
                 else "")
    print(f"  ringsync overhead / bound: {ours / bound:.2f} (goal <= 1.5); "
          f"/ JAX gloo's overhead: {ours / over['JAX gloo']:.3f} (goal <= 0.33){callbacks}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per sample")
    parser.add_argument("--rounds", type=int, default=4, help="samples per setup")
    args = parser.parse_args()
    hvd.init()
    if COMM.rank == 0:
        print(f"{COMM.size} ranks, jax {jax.__version__}, batch {args.batch} per rank; "
              f"ringsync's custom call {'on' if _xla.FFI_AVAILABLE else 'OFF'}")
    for name in args.models:
        times, bound, nbytes = measure(name, args)
        if COMM.rank == 0:
            report(name, times, bound, nbytes)
    hvd.shutdown()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
