"""JAX adapter bodies, run on every rank under mpirun. References come from every rank's
input (each rank computes all of them) or from one process training on the whole batch."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64 and int64 arrays, as numpy has them

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ringsync.jax as hvd  # noqa: E402

from tests.common.reference import (MOVABLE, OPS, REDUCIBLE, assert_reduced,  # noqa: E402
                                    rank_input, reference_allreduce)

SHAPES = [(0,), (1,), (7, 3), (101,)]


def _jx(rank, shape, dtype, op="Sum", salt=""):
    return jnp.asarray(rank_input(rank, shape, dtype, op, salt))


def _same(got, expected, what):
    got = np.asarray(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape, \
        f"{what}: {got.dtype}{got.shape} != {expected.dtype}{expected.shape}"
    assert np.array_equal(got, expected), f"{what}: {got} != {expected}"


def _allreduce_matrix(mode, me, size):
    for dtype in REDUCIBLE:
        for op in OPS:
            for shape in SHAPES if mode == "eager" else SHAPES[1:3]:
                inputs = [rank_input(r, shape, dtype, op, "j") for r in range(size)]
                what = f"jax {mode} allreduce {dtype} {op} {shape}"

                def reduce(x, op=op):
                    return hvd.allreduce(x, op=getattr(hvd, op), prescale_factor=0.5,
                                         postscale_factor=2.0)

                fn = reduce if mode == "eager" else jax.jit(reduce)
                got = fn(_jx(me, shape, dtype, op, "j"))
                assert_reduced(np.asarray(got), inputs, op, 0.5, 2.0, what=what)


def _moving_matrix(mode, me, size):
    def run(fn, *args):
        return fn(*args) if mode == "eager" else jax.jit(fn)(*args)

    for dtype in MOVABLE:
        rows = (me + 1) if mode == "eager" else 2  # a traced shape is fixed: equal rows
        parts = [rank_input(r, ((r + 1) if mode == "eager" else 2, 3), dtype, "Sum", "g")
                 for r in range(size)]
        _same(run(hvd.allgather, jnp.asarray(parts[me])), np.concatenate(parts),
              f"{mode} allgather {dtype}")
        assert parts[me].shape[0] == rows
        for root in range(size):
            data = [rank_input(r, (4, 2), dtype, "Sum", f"b{root}") for r in range(size)]
            _same(run(lambda x, root=root: hvd.broadcast(x, root), jnp.asarray(data[me])),
                  data[root], f"{mode} broadcast {dtype} root {root}")
        sent = [rank_input(r, (size * 2, 2), dtype, "Sum", "a") for r in range(size)]
        expected = np.concatenate([sent[r][me * 2:me * 2 + 2] for r in range(size)])
        _same(run(hvd.alltoall, jnp.asarray(sent[me])), expected, f"{mode} alltoall {dtype}")
    for dtype in REDUCIBLE:
        for op in ["Sum", "Average"]:
            inputs = [rank_input(r, (2 * size + 1, 3), dtype, op, "s") for r in range(size)]
            full = reference_allreduce(inputs, op)
            start = sum(2 + (r < 1) for r in range(me))
            got = run(lambda x, op=op: hvd.reducescatter(x, op=getattr(hvd, op)),
                      jnp.asarray(inputs[me]))
            assert_reduced(np.asarray(got), [x[start:start + 2 + (me < 1)] for x in inputs], op,
                           what=f"{mode} reducescatter {dtype} {op}")
            assert full.shape[0] == 2 * size + 1


def _grouped(mode, me, size):
    tree = {"w": _jx(me, (3, 4), "float32"), "b": [_jx(me, (5,), "int32"),
                                                   _jx(me, (2,), "bfloat16")]}
    fn = (lambda t: hvd.grouped_allreduce(t, op=hvd.Sum))
    got = fn(tree) if mode == "eager" else jax.jit(fn)(tree)
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        mine = [jax.tree_util.tree_leaves_with_path(
            {"w": _jx(r, (3, 4), "float32"), "b": [_jx(r, (5,), "int32"),
                                                   _jx(r, (2,), "bfloat16")]})
            for r in range(size)]
        inputs = [np.asarray(dict((str(p), v) for p, v in m)[str(path)]) for m in mine]
        assert_reduced(np.asarray(leaf), inputs, "Sum", what=f"{mode} grouped {path}")
    fused = hvd.fused_allreduce(tree, op=hvd.Sum)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(got)):
        _same(a, np.asarray(b), f"{mode} fused_allreduce")


def collective_matrix(mode):
    """Every collective, eager or jitted, against numpy references of every rank's input.
    Jitted allreduces are the native core's XLA custom call (unless RINGSYNC_JAX_FFI=0)."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    if mode == "jit":
        program = jax.jit(lambda x: hvd.allreduce(x)).lower(jnp.ones(3)).as_text()
        ffi = os.environ.get("RINGSYNC_JAX_FFI", "1") != "0"
        assert ("ringsync_allreduce" in program) == ffi, program
    _allreduce_matrix(mode, me, size)
    _moving_matrix(mode, me, size)
    _grouped(mode, me, size)
    hvd.barrier()
    assert hvd.broadcast_object({"rank": me}, root_rank=size - 1) == {"rank": size - 1}
    assert hvd.allgather_object(me * 10) == [r * 10 for r in range(size)]
    print(f"--- collective matrix ({mode}) passed on rank {me}", flush=True)
    hvd.shutdown()


def gradients_by_horovods_rules():
    """allreduce's vjp is an allreduce of the cotangent; allgather's is this rank's rows
    of the averaged cotangent; broadcast's the averaged cotangent on the root only;
    reducescatter's the cotangents allgathered (times the size for a Sum, as Horovod's
    torch rule has it); jitted and not."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    x = jnp.arange(6.0) * (me + 1)
    w = [jnp.arange(6.0) + 10 * r for r in range(size)]  # rank r's cotangent weights
    mean_w = sum(w) / size
    for wrap in [lambda f: f, jax.jit]:
        g = wrap(jax.grad(lambda x: (hvd.allreduce(x, op=hvd.Sum) * w[me]).sum()))(x)
        np.testing.assert_allclose(g, sum(w))
        g = wrap(jax.grad(lambda x: (hvd.allreduce(x) * w[me]).sum()))(x)
        np.testing.assert_allclose(g, mean_w)
        xs = x.reshape(3, 2)
        ws = [jnp.arange(6.0 * size).reshape(3 * size, 2) * (r + 1) for r in range(size)]
        g = wrap(jax.grad(lambda x: (hvd.allgather(x) * ws[me]).sum()))(xs)
        np.testing.assert_allclose(g, (sum(ws) / size)[3 * me:3 * me + 3])
        g = wrap(jax.grad(lambda x: (hvd.broadcast(x, size - 1) * w[me]).sum()))(x)
        np.testing.assert_allclose(g, mean_w if me == size - 1 else 0 * mean_w)
        big = jnp.arange(4.0 * size) * (me + 1)
        wr = [jnp.arange(4.0) + r for r in range(size)]
        g = wrap(jax.grad(lambda x: (hvd.reducescatter(x, op=hvd.Sum) * wr[me]).sum()))(big)
        # (Horovod's rule: a Sum's gradient is the gathered cotangents times the size)
        np.testing.assert_allclose(g, jnp.concatenate(wr) * size)
        tree = {"a": x, "b": 2 * x}
        g = wrap(jax.grad(lambda t: sum((v * w[me]).sum()
                                        for v in hvd.grouped_allreduce(t).values())))(tree)
        np.testing.assert_allclose(g["a"], mean_w)
        np.testing.assert_allclose(g["b"], mean_w)
    try:
        jax.grad(lambda x: hvd.allreduce(x, op=hvd.Max).sum())(x)
    except hvd.UsageError as error:
        assert "gradient of a Max reduction" in str(error), error
    else:
        raise AssertionError("the gradient of a Max allreduce was not refused")
    try:
        jax.vmap(hvd.allreduce)(jnp.ones((2, 3)))
    except hvd.UsageError as error:
        assert "vmap over a collective" in str(error), error
    else:
        raise AssertionError("vmap over allreduce was not refused")
    hvd.shutdown()


# ---------------------------------------------------------------- training equivalence

def _digits():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float64), y.astype(np.int32)


def _init_mlp(seed, dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": (jax.random.normal(k1, (64, 32)) * 0.1).astype(dtype),
            "b1": jnp.zeros(32, dtype),
            "w2": (jax.random.normal(k2, (32, 10)) * 0.1).astype(dtype),
            "b2": jnp.zeros(10, dtype)}


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])


def _train(tx, params, batches, wrap_grads=lambda g: g):
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = wrap_grads(jax.grad(_loss)(params, x, y))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for x, y in batches:
        params, state = step(params, state, x, y)
    return params


def training_matches_one_process(dtype_name="float64"):
    """N ranks, each on 1/N of every batch with DistributedOptimizer(adam) in a jitted step,
    end where one process on the whole batches does (float64 to 1e-9, float32 to 1e-5);
    also under optax.MultiSteps and with backward_passes_per_step, and (float64) with
    op=Sum and gradient_predivide_factor. Each reference is trained once (a jitted step
    compiles in about a second, on every rank)."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    dtype = jnp.dtype(dtype_name)
    tol = 1e-9 if dtype_name == "float64" else 1e-5
    x, y = _digits()
    x = x.astype(dtype)
    batch = 12 * size
    batches = [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(8)]
    mine = [(bx[me::size], by[me::size]) for bx, by in batches]
    # The ranks start from different parameters until broadcast_parameters.
    params = hvd.broadcast_parameters(_init_mlp(me, dtype), root_rank=0)
    start = _init_mlp(0, dtype)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start)):
        assert np.array_equal(a, b)

    def check(got, expected, what):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected)):
            err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
            assert err <= tol * max(1.0, float(np.max(np.abs(np.asarray(b))))), \
                f"{what} {path}: off by {err}"
        same = hvd.allgather_object([np.asarray(a).tobytes() for a in jax.tree.leaves(got)])
        assert all(s == same[0] for s in same), f"{what}: the ranks' parameters differ"

    # Adam divides by sqrt(v) + eps: a gradient near zero turns a round-off difference of
    # 1e-17 (a mean of means against one mean) into up to 1e-17 / eps of update. eps=1e-6
    # bounds that below the tolerance; the default 1e-8 would not, on any backend.
    adam = optax.adam(1e-2, eps=1e-6)
    # Strided rows: the mean of the ranks' means is the whole batch's mean (equal shares).
    got = _train(hvd.DistributedOptimizer(adam), params, mine)
    check(got, _train(adam, start, batches), f"{dtype_name} adam")

    def multi(tx):  # (MultiSteps accumulates in float32 unless told otherwise)
        return optax.MultiSteps(tx, 2, accumulator_dtype=dtype).gradient_transformation()

    two_steps = _train(multi(adam), start, batches)
    got = _train(hvd.DistributedOptimizer(adam, backward_passes_per_step=2), params, mine)
    check(got, two_steps, f"{dtype_name} backward_passes_per_step=2")
    if dtype_name != "float64":  # (the rest scale or wrap gradients whatever their dtype)
        hvd.shutdown()
        return
    got = _train(multi(hvd.DistributedOptimizer(adam)), params, mine)
    check(got, two_steps, f"{dtype_name} MultiSteps")
    sgd = optax.sgd(0.1)
    one_process = _train(sgd, start, batches)
    got = _train(hvd.DistributedOptimizer(sgd, op=hvd.Sum), params, mine,
                 lambda g: jax.tree.map(lambda v: v / size, g))
    check(got, one_process, f"{dtype_name} Sum")
    got = _train(hvd.DistributedOptimizer(sgd, gradient_predivide_factor=2.0), params, mine)
    check(got, one_process, f"{dtype_name} predivide")
    hvd.shutdown()


def errors_leave_the_next_step_working():
    """Ranks whose jitted step disagrees (shapes, dtypes) all fail the step, naming what
    differs; the next step works on every rank."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    step = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum, name="grads") * 2)
    for bad, what in [(jnp.ones(3 + (me == size - 1)), "shape"),
                      (jnp.ones(3, jnp.float32 if me == size - 1 else jnp.float64), "dtype")]:
        try:
            np.asarray(step(bad))
        except Exception as error:  # JAX re-raises the callback's error as its own
            text = str(error)
            assert "grads" in text and ("MismatchError" in text or "mismatch" in text), text
        else:
            if size > 1:
                raise AssertionError(f"a {what} mismatch did not fail rank {me}")
        got = step(jnp.arange(4.0) + me)
        np.testing.assert_allclose(got, 2 * sum(jnp.arange(4.0) + r for r in range(size)))
    hvd.shutdown()


def independent_collectives_pair_up():
    """Four allreduces of one shape that nothing orders in the program (no data flows
    between them): every rank must run them in the same order, or values would meet their
    neighbours' (a sum of the wrong arrays, not an error). 200 steps, with XLA's default
    threads."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()

    @jax.jit
    def step(a, b, c, d):
        return [hvd.allreduce(v * 2.0, op=hvd.Sum) for v in (a, b, c, d)]

    for i in range(200):
        out = step(*[jnp.full((257,), 1000.0 * k + 10 * me + i) for k in range(4)])
        for k, got in enumerate(out):
            expected = sum(2 * (1000.0 * k + 10 * r + i) for r in range(size))
            assert np.all(np.asarray(got) == expected), (i, k, np.asarray(got)[:3], expected)
    hvd.shutdown()


def _depends_on(defs, value, target):
    """Whether SSA value `value` of a StableHLO text is computed from `target`."""
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        if v == target:
            return True
        if v not in seen:
            seen.add(v)
            todo += defs.get(v, [])
    return False


def chained_in_program_order():
    """The custom calls of one trace form a chain: each takes, as an operand it does not
    read, something computed from the previous call's result (what makes XLA run them in
    program order); unnamed ones get distinct names."""
    import re
    hvd.init()
    xs = [jnp.ones(5) * k for k in range(3)]
    for fn in [lambda a, b, c: [hvd.allreduce(v) for v in (a, b, c)],
               lambda a, b, c: jax.grad(lambda t: sum(hvd.allreduce(v).sum() for v in t))(
                   (a, b, c))]:
        text = jax.jit(fn).lower(*xs).as_text()
        defs, calls = {}, []
        for line in text.splitlines():
            m = re.match(r"\s*(%[\w#]+)(?::\d+)? = (.*)", line)
            if m:
                defs[m.group(1)] = re.findall(r"%[\w#]+", m.group(2))
                if "custom_call @ringsync_allreduce" in line:
                    operands = m.group(2).split("(", 1)[1].split(")", 1)[0]
                    calls.append((m.group(1), re.findall(r"%[\w#]+", operands),
                                  re.search(r'name = "([^"]+)"', line).group(1)))
        assert len(calls) >= 3, text
        for (before, _, _), (_, operands, _) in zip(calls, calls[1:]):
            assert len(operands) == 2 and _depends_on(defs, operands[1], before), calls
        assert len({name for _, _, name in calls}) == len(calls), calls
    hvd.shutdown()


def unordered_programs_fail_loudly():
    """Two jitted programs whose collectives nothing orders, run at once from two threads
    on rank 0 (its first call waits for a late rank 1, so the second overlaps it): rank 0
    refuses the second call, rank 1's matching call fails naming the reason, and the
    first pair meets as it should. Then a plain call works on both."""
    import threading
    import time
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    first = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum, name="first"))
    second = jax.jit(lambda x: hvd.allreduce(x * 1.0, op=hvd.Sum, name="second"))
    x = jnp.arange(4.0) + me
    jax.block_until_ready((first(x), second(x)))  # compiled (and matched) once, in order
    results = {}

    def run(name, fn, delay):
        time.sleep(delay)
        try:
            results[name] = np.asarray(fn(x))
        except Exception as error:  # JAX's own error, carrying ringsync's text
            results[name] = str(error)

    if me == 0:
        threads = [threading.Thread(target=run, args=("first", first, 0.0)),
                   threading.Thread(target=run, args=("second", second, 0.3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        time.sleep(1.0)  # rank 0's first call is waiting for this rank by now
        run("first", first, 0.0)
        run("second", second, 0.0)
    expected = sum(np.arange(4.0) + r for r in range(size))
    assert np.array_equal(results["first"], expected), results
    assert isinstance(results["second"], str) and "at the same time" in results["second"], \
        results
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum), expected)
    hvd.shutdown()


def checkpoints_of_pytrees(folder):
    """A pytree (float32, bfloat16 and int leaves, an optax state) saved on every rank
    (each writing its slices) loads back equal on every rank, and on a set of rank 0
    alone (another rank count); a leaf of another shape is named; a part that would run
    code on load is refused."""
    import pickle
    from ringsync.checkpoint import CheckpointError
    import ringsync.jax.checkpoint as ckpt
    hvd.init()
    me = hvd.rank()
    params = {"w": jnp.arange(37.0, dtype=jnp.float32).reshape(37, 1) / 7,
              "b": jnp.arange(5, dtype=jnp.bfloat16), "n": jnp.arange(11, dtype=jnp.int32)}
    tree = {"params": params, "opt": optax.adam(1e-3).init(params)}
    ckpt.save(folder, tree, step=7)
    zeros = jax.tree.map(jnp.zeros_like, tree)
    got, extra = ckpt.load(folder, zeros)
    assert extra == {"step": 7}, extra
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
        _same(a, np.asarray(b), "loaded leaf")
    alone = hvd.add_process_set([0])
    if me == 0:
        got, _ = ckpt.load(folder, zeros, process_set=alone)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
            _same(a, np.asarray(b), "loaded on one rank")
    hvd.barrier()
    try:
        ckpt.load(folder, {**zeros, "params": {**zeros["params"], "w": jnp.zeros((36, 1))}})
    except CheckpointError as error:
        assert "['params']['w']" in str(error) and "[37, 1]" in str(error), error
    else:
        raise AssertionError("a leaf of another shape was loaded")
    hvd.barrier()
    if me == 0:  # a part that would call os.system when unpickled
        class Evil:
            def __reduce__(self):
                return (os.system, ("true",))
        evil = os.path.join(folder, "evil.pt")
        with open(evil, "wb") as f:
            pickle.dump({"format": 1, "pieces": {}, "whole": {"x": Evil()}}, f)
        try:
            ckpt.CODEC.load(evil)
        except pickle.UnpicklingError as error:
            assert "posix.system is not allowed" in str(error), error
        else:
            raise AssertionError("a part that runs code was loaded")
    hvd.shutdown()
