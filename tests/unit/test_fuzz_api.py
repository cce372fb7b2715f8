"""Fuzzed API input (hypothesis), on thread ranks: every collective of the numpy API and
of the torch, TensorFlow and JAX adapters, with shapes (0-d, empty, primes, non-contiguous,
negative and zero strides, read-only, plain buffers, aliased output), every dtype, op,
root, splits, name (unicode, past the core's limit, NUL, duplicates in flight), scale
factor and process set, sometimes made differently by one rank. Each example runs on 2 or
3 thread ranks that live for the whole module (tests/common/fuzz_strategies.py draws the
cases and knows the answers) and checks:

* a valid call: every member's result equals the numpy reference built from every
  member's input, and out-of-place calls leave the input as it was;
* an invalid one: every member raises ringsync.errors.UsageError (or a subclass) whose
  message names the problem;
* either way, a valid allreduce on the same communicator (and on the process set) then
  returns the right answer on every rank: a failed call leaves the next working.

Deterministic (derandomize, no example database). RINGSYNC_FUZZ_EXAMPLES multiplies the
number of examples for a soak run, e.g. RINGSYNC_FUZZ_EXAMPLES=20.
"""
import dataclasses
import os
import queue
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis.configuration import set_hypothesis_home_dir

import ringsync as rs
from ringsync import Communicator, Config
from ringsync._context import resolve
from ringsync._native import ffi, lib
from ringsync.errors import UsageError
from ringsync.process_sets import ProcessSet, Registry
from ringsync.rendezvous import ThreadGroup

from tests.common import fuzz_strategies as fz
from tests.thread_ranks import PATHS, assert_ranks_ok

DEADLINE_S = 60.0  # one example on every rank; past it the test fails showing every rank
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}
# (ranks, same-host path): the lane (blocking calls matched in call order) and the engine
# alone (negotiated by name).
POOLS = [(2, "shm"), (3, "shm"), (2, "shm-ring"), (3, "shm-ring")]
SET_RANKS = {2: [1], 3: [0, 2]}  # each pool's process set (world ranks)
SOAK = max(1, int(os.environ.get("RINGSYNC_FUZZ_EXAMPLES", "1")))
# Hypothesis caches the constants of the code under test in .hypothesis/ even without an
# example database: keep the checkout clean.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "ringsync-hypothesis"))


def fuzz_settings(examples: int):
    return settings(max_examples=examples * SOAK, deadline=None, derandomize=True,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# ------------------------------------------------------------------ ranks that stay


@dataclasses.dataclass
class RankContext:
    rank: int
    size: int
    world: Communicator
    process_set: ProcessSet


class RankPool:
    """`size` thread ranks, each with its Communicator and a process set of SET_RANKS,
    that run whatever run() hands them, one function at a time, until close()."""

    def __init__(self, size: int, path: str):
        self.size, self.path, self.broken = size, path, False
        self.group = ThreadGroup(size, DEADLINE_S)
        self.inbox = [queue.Queue() for _ in range(size)]
        self.outbox = queue.Queue()
        self.comms = [None] * size
        self.threads = [threading.Thread(target=self._main, args=(r,), daemon=True,
                                         name=f"fuzz-{path}-{r}") for r in range(size)]
        for t in self.threads:
            t.start()
        started = self._collect("start")
        failed = [value for kind, value in started if kind != "ok"]
        if failed:
            raise AssertionError(f"the pool did not start: {failed}")

    def _main(self, rank: int) -> None:
        try:
            config = Config.from_env(environ={**ENV, **PATHS[self.path]})
            comm = Communicator(rendezvous=self.group.rendezvous(rank), config=config)
            self.comms[rank] = comm
            registry = Registry(comm)
            ps = registry.add(ProcessSet(SET_RANKS[self.size]))
            ctx = RankContext(rank, self.size, comm, ps)
        except BaseException as exc:
            self.group.abort()
            self.outbox.put((rank, "raised", exc))
            return
        self.outbox.put((rank, "ok", None))
        while True:
            fn = self.inbox[rank].get()
            if fn is None:
                break
            try:
                self.outbox.put((rank, "ok", fn(ctx)))
            except BaseException as exc:  # (the test judges it)
                exc.rank_traceback = traceback.format_exc()
                self.outbox.put((rank, "raised", exc))
        if self.broken:
            comm.abort("the fuzz pool is broken")
        else:
            registry.close()
            comm.shutdown()

    def run(self, fn):
        """[(kind, value)] by rank: fn(ctx) on every rank, "ok" with its value or "raised"
        with its exception. A hang past the deadline fails with every rank's stack."""
        for q in self.inbox:
            q.put(fn)
        return self._collect(getattr(fn, "__name__", "call"))

    def _collect(self, what: str):
        results, deadline = {}, time.monotonic() + DEADLINE_S
        while len(results) < self.size:
            try:
                rank, kind, value = self.outbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._interrupt(what, results)
            results[rank] = (kind, value)
        return [results[r] for r in range(self.size)]

    def _interrupt(self, what, results):
        frames = sys._current_frames()
        stacks = [f"--- rank {r}: still running {what} after {DEADLINE_S:g} s, at\n" +
                  "".join(traceback.format_stack(frames[t.ident]))
                  for r, t in enumerate(self.threads) if r not in results and t.ident in frames]
        self.broken = True
        for comm in self.comms:  # (only fail the calls: their threads still use the engines)
            engine = comm._ring.engine if comm is not None else ffi.NULL
            if engine != ffi.NULL:
                lib.rs_engine_abort(engine, b"the fuzz test's deadline passed")
        raise AssertionError("\n".join([f"{what} hung on {self.size} thread ranks:"] + stacks))

    def close(self) -> None:
        for q in self.inbox:
            q.put(None)
        for t in self.threads:
            t.join(DEADLINE_S)


class Pools:
    """The module's pools, built on first use; a pool broken by a hang is built anew."""

    def __init__(self):
        self.pools = {}

    def get(self, size: int, path: str) -> RankPool:
        pool = self.pools.get((size, path))
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self.pools[(size, path)] = RankPool(size, path)
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="module")
def pools():
    made = Pools()
    yield made
    made.close()


# ------------------------------------------------------------------ calls, on each rank


OPS = {name: getattr(rs, name) for name in fz.OPS}


def _numpy_call(case: fz.Case, ctx: RankContext):
    """Make the case's call through the numpy API on this rank; returns (results, inputs
    as passed, what the rank's input arrays hold afterwards)."""
    comm = resolve(ctx.process_set) if case.in_set else ctx.world
    me, call = ctx.rank, case.call
    op = OPS[case.field_of(me, "op")]
    pre, post = case.field_of(me, "prescale"), case.postscale
    root = case.field_of(me, "root")
    count = case.group if call.startswith("grouped") else 1
    xs = [fz.numpy_layout(fz.rank_input(case, me, i), case.layout) for i in range(count)]
    x = xs[0]
    if call == "allreduce":
        out = comm.allreduce(x, op, pre, post, case.name)
    elif call == "allreduce_":
        out = comm.allreduce_(x, op, pre, post, case.name)
    elif call == "allreduce_async":
        out = comm.synchronize(comm.allreduce_async(x, op, pre, post, case.name))
    elif call == "allreduce_async_":
        out = comm.synchronize(comm.allreduce_async_(x, op, pre, post, case.name))
    elif call == "allreduce_into":
        out = _allreduce_into(comm, case, x, op, pre, post)
    elif call == "grouped_allreduce":
        out = comm.grouped_allreduce(xs, op, pre, post, case.name)
    elif call == "grouped_allreduce_":
        out = comm.grouped_allreduce_(xs, op, pre, post, case.name)
    elif call == "allgather":
        out = comm.allgather(x, case.name)
    elif call == "allgather_async":
        out = comm.synchronize(comm.allgather_async(x, case.name))
    elif call == "broadcast":
        out = comm.broadcast(x, root, case.name)
    elif call == "broadcast_":
        out = comm.broadcast_(x, root, case.name)
    elif call == "broadcast_async":
        out = comm.synchronize(comm.broadcast_async(x, root, case.name))
    elif call == "reducescatter":
        out = comm.reducescatter(x, op, pre, post, case.name)
    elif call == "alltoall":
        splits = case.splits[me] if case.splits else None
        out = comm.alltoall(x, splits, case.name)
        if splits is not None:
            out, received = out
            _check_received(case, ctx, comm, received)
    elif call == "duplicate_in_flight":
        out = _duplicate_in_flight(comm, case, x, op, pre, post)
    else:
        raise AssertionError(call)
    outs = out if isinstance(out, list) else [out]
    return [np.asarray(o) for o in outs], xs


def _allreduce_into(comm, case, x, op, pre, post):
    if case.alias == "alias":
        return comm.allreduce_into(x, x, op, pre, post, case.name)
    if case.alias == "overlap":  # out starts one element before x, in the same memory
        flat = np.asarray(x).reshape(-1)
        base = np.empty(flat.size + 1, flat.dtype)
        base[1:] = flat
        x_view = base[1:].reshape(np.shape(x))
        return comm.allreduce_into(x_view, base[:-1].reshape(np.shape(x)), op, pre, post,
                                   case.name)
    out = np.full(np.shape(x), 7, np.asarray(x).dtype)
    return comm.allreduce_into(x, out, op, pre, post, case.name)


def _duplicate_in_flight(comm, case, x, op, pre, post):
    """A name submitted again while in flight must be refused naming it; the first call
    then completes, right."""
    name = case.name
    first = comm.allreduce_async(x, op, pre, post, name)
    try:
        comm.allreduce_async(x, op, pre, post, name)
    except UsageError as exc:
        if "in flight" not in str(exc):
            raise AssertionError(f"the refusal does not say the name is in flight: {exc}")
    else:
        raise AssertionError(f"a second allreduce named {name!r} in flight was accepted")
    return comm.synchronize(first)


def _check_received(case, ctx, comm, received):
    ranks = fz.members(case, SET_RANKS[ctx.size])
    me = ranks.index(ctx.rank)
    want = [case.splits[r][me] for r in ranks]
    if list(np.asarray(received)) != want:
        raise AssertionError(f"rank {ctx.rank}: alltoall says it received {received} rows "
                             f"per rank, expected {want}")


# ------------------------------------------------------------------ the checks


def _judge_outcomes(case: fz.Case, outcomes, inputs_of=None):
    """Every member got the reference result, or every member raised a UsageError naming
    one of its problems. Returns one line per rank for the report."""
    set_ranks = SET_RANKS[case.size]
    expected = {r: fz.expected_problems(case, r, set_ranks) for r in range(case.size)}
    ranks = fz.members(case, set_ranks)
    valid = all(expected[r] is None for r in ranks)
    event(f"{case.api} {case.call}: {'valid' if valid else 'refused'}")
    failures = []
    for rank, (kind, value) in enumerate(outcomes):
        if not valid or expected[rank] is not None:
            failures += _judge_error(case, rank, kind, value, expected[rank])
        else:
            failures += _judge_result(case, rank, kind, value, ranks)
    if failures:
        lines = [f"{case}", f"expected: {expected}"] + failures + [
            f"--- rank {r}: {kind}: {_describe(value)}" for r, (kind, value) in
            enumerate(outcomes)]
        raise AssertionError("\n".join(lines))


def _describe(value):
    if isinstance(value, BaseException):
        return getattr(value, "rank_traceback", repr(value))[-3000:]
    return repr(value)[:500]


def _judge_error(case, rank, kind, value, problems):
    if kind != "raised":
        return [f"rank {rank}: succeeded, expected a UsageError naming one of {problems}"]
    if not isinstance(value, UsageError):
        return [f"rank {rank}: raised {type(value).__name__}, not a UsageError"]
    if problems is None:  # (a peer's problem: this rank only has to fail)
        return []
    message = str(value).lower()
    if any(all(f.lower() in message for f in problem) for problem in problems):
        return []
    return [f"rank {rank}: the message names none of {problems}: {str(value)[:400]}"]


def _judge_result(case, rank, kind, value, ranks):
    if kind != "ok":
        return [f"rank {rank}: raised, expected a result"]
    outs, passed = value
    failures = []
    for i, got in enumerate(outs):
        inputs = {r: fz.rank_input(case, r, i) for r in ranks}
        wrong = fz.mismatch(case, rank, got, inputs, i)
        if wrong:
            failures.append(f"rank {rank}: tensor {i}: {wrong}")
        failures += _judge_memory(case, rank, got, passed[i], inputs[rank])
    return failures


def _judge_memory(case, rank, got, passed, mine):
    """In-place calls leave the result in the caller's memory; others leave it as it was."""
    held = np.asarray(passed)
    if case.call in fz.IN_PLACE or (case.call == "allreduce_into" and case.alias == "alias"):
        if not fz._same_bits(held, got):
            return [f"rank {rank}: the in-place result is not in the array passed"]
        return []
    if not fz._same_bits(held, mine):
        return [f"rank {rank}: the input was changed by an out-of-place call"]
    return []


def _follow_up(pool: RankPool, case: fz.Case):
    """A valid allreduce on the world, then on the process set (its members), returns the
    right answer on every rank: the failed call left both working."""
    set_ranks = SET_RANKS[pool.size]

    def follow_up(ctx):
        mine = np.arange(5, dtype=np.int64) * (ctx.rank + 1) + case.seed
        got = [ctx.world.allreduce(mine, rs.Sum, name=f"fz.next.{case.seed}")]
        if ctx.rank in set_ranks:
            got.append(resolve(ctx.process_set).allreduce(mine, rs.Sum))
        return got

    outcomes = pool.run(follow_up)
    world = sum(np.arange(5, dtype=np.int64) * (r + 1) + case.seed for r in range(pool.size))
    subset = sum(np.arange(5, dtype=np.int64) * (r + 1) + case.seed for r in set_ranks)
    for rank, (kind, value) in enumerate(outcomes):
        want = [world] + ([subset] if rank in set_ranks else [])
        if kind != "ok" or not all(np.array_equal(g, w) for g, w in zip(value, want)):
            raise AssertionError(f"after {case}\nthe next call failed on rank {rank}: "
                                 f"{_describe(value)}; expected {want}")


def _run_case(pools, case: fz.Case, call):
    pool = pools.get(case.size, case.path)
    try:
        outcomes = pool.run(lambda ctx: call(case, ctx))
        try:
            _judge_outcomes(case, outcomes)
        finally:
            _follow_up(pool, case)
    except BaseException:
        pool.broken = True  # (the next example, or shrinking, starts on fresh rings)
        raise


# ------------------------------------------------------------------ the tests


def _case(**fields) -> fz.Case:
    """A Case for an explicit example: a valid float32 allreduce on 2 ranks but for
    `fields`."""
    base = dict(size=2, path="shm", api="numpy", call="allreduce", dtype="float32",
                shapes=((5,), (5,)), group=1, layout="contiguous", alias="separate", op="Sum",
                prescale=1.0, postscale=1.0, root=0, splits=None, name=None, in_set=False,
                seed=1)
    base.update(fields)
    return fz.Case(**base)


# The failures the fuzzing found, pinned (each fixed in ringsync; see the commit log).
@example(case=_case(call="allreduce_", shapes=((), ()), layout="scalar"))  # result lost
@example(case=_case(call="allreduce_into", alias="overlap", shapes=((7,), (7,))))
@example(case=_case(op="Adasum", dtype="uint8", name="€" * 1333))  # error text cut, undecodable
@example(case=_case(call="allreduce_into", alias="alias", shapes=((3, 2), (3, 2))))
@fuzz_settings(400)
@given(case=fz.cases(POOLS))
def test_numpy_api(pools, case):
    _run_case(pools, case, _numpy_call)


# ------------------------------------------------------------------ the adapters


def _framework_args(case: fz.Case, ctx: RankContext):
    """(this rank's op, prescale, root, splits, process_set) as the adapters take them."""
    me = ctx.rank
    where = ctx.process_set if case.in_set else ctx.world
    splits = case.splits[me] if case.splits else None
    return (OPS[case.field_of(me, "op")], case.field_of(me, "prescale"),
            case.field_of(me, "root"), splits, where)


def _torch_tensor(x: np.ndarray, layout: str):
    import torch
    from ringsync.torch._tensors import from_numpy
    t = from_numpy(np.array(x, copy=True, order="C"))
    if layout == "strided" and t.dim():
        base = torch.zeros((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype)
        base[::2] = t
        return base[::2]
    if layout == "transposed" and t.dim() >= 2:
        return t.T.contiguous().T
    if layout == "requires_grad" and t.is_floating_point():
        return t.requires_grad_(True)
    if layout == "expanded" and t.dim() and t.shape[0]:
        return t[:1].expand(t.shape)  # (rank_input made the rows alike)
    return t


def _from_torch(t) -> np.ndarray:
    from ringsync.torch._tensors import to_numpy
    return to_numpy(t.detach().contiguous(), "test").copy()


def _torch_call(case: fz.Case, ctx: RankContext):
    import ringsync.torch as hvd
    op, pre, root, splits, where = _framework_args(case, ctx)
    kw = dict(name=case.name, process_set=where)
    scale = dict(prescale_factor=pre, postscale_factor=case.postscale)
    count = case.group if case.call.startswith("grouped") else 1
    ts = [_torch_tensor(fz.rank_input(case, ctx.rank, i), case.layout) for i in range(count)]
    t, call = ts[0], case.call
    if call == "allreduce":
        out = hvd.allreduce(t, op=op, **scale, **kw)
    elif call == "allreduce_":
        out = hvd.allreduce_(t, op=op, **scale, **kw)
        assert out is t, "allreduce_ did not return its tensor"
    elif call == "allreduce_async":
        out = hvd.synchronize(hvd.allreduce_async(t, op=op, **scale, **kw))
    elif call == "grouped_allreduce":
        out = hvd.grouped_allreduce(ts, op=op, **scale, **kw)
    elif call == "allgather":
        out = hvd.allgather(t, **kw)
    elif call == "broadcast":
        out = hvd.broadcast(t, root, **kw)
    elif call == "broadcast_":
        out = hvd.broadcast_(t, root, **kw)
    elif call == "reducescatter":
        out = hvd.reducescatter(t, op=op, **scale, **kw)
    elif call == "alltoall":
        import torch
        out = hvd.alltoall(t, None if splits is None else torch.tensor(splits), **kw)
        if splits is not None:
            out, received = out
            _check_received(case, ctx, None, received.tolist())
    else:
        raise AssertionError(call)
    outs = out if isinstance(out, list) else [out]
    return [_from_torch(o) for o in outs], [_from_torch(x) for x in ts]


def _tf_call(case: fz.Case, ctx: RankContext):
    import tensorflow as tf
    import ringsync.tensorflow as hvd
    op, pre, root, splits, where = _framework_args(case, ctx)
    kw = dict(name=case.name, process_set=where)
    count = case.group if case.call.startswith("grouped") else 1
    xs = [fz.rank_input(case, ctx.rank, i) for i in range(count)]
    make = tf.Variable if case.layout == "variable" or case.call == "broadcast_" else tf.constant
    ts = [make(x) for x in xs]
    t, call = ts[0], case.call
    if call == "allreduce":
        out = hvd.allreduce(t, op=op, prescale_factor=pre, postscale_factor=case.postscale, **kw)
    elif call == "grouped_allreduce":
        out = hvd.grouped_allreduce(ts, op=op, prescale_factor=pre,
                                    postscale_factor=case.postscale, **kw)
    elif call == "allgather":
        out = hvd.allgather(t, **kw)
    elif call == "broadcast":
        out = hvd.broadcast(t, root, **kw)
    elif call == "broadcast_":
        out = hvd.broadcast_(t, root, **kw)
    elif call == "reducescatter":
        out = hvd.reducescatter(t, op=op, prescale_factor=pre,
                                postscale_factor=case.postscale, **kw)
    elif call == "alltoall":
        out = hvd.alltoall(t, splits, **kw)
        if splits is not None:
            out, received = out
            _check_received(case, ctx, None, received.numpy().tolist())
    else:
        raise AssertionError(call)
    outs = out if isinstance(out, list) else [out]
    return [np.asarray(o.numpy()) for o in outs], [np.asarray(x.numpy()) for x in ts]


def _jax_call(case: fz.Case, ctx: RankContext):
    import jax.numpy as jnp
    import ringsync.jax as hvd
    op, pre, root, splits, where = _framework_args(case, ctx)
    kw = dict(name=case.name, process_set=where)
    count = case.group if case.call.startswith("grouped") else 1
    xs = [jnp.asarray(fz.rank_input(case, ctx.rank, i)) for i in range(count)]
    x, call = xs[0], case.call
    if call == "allreduce":
        out = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=case.postscale, **kw)
    elif call == "grouped_allreduce":
        out = hvd.grouped_allreduce(xs, op=op, prescale_factor=pre,
                                    postscale_factor=case.postscale, **kw)
    elif call == "allgather":
        out = hvd.allgather(x, **kw)
    elif call == "broadcast":
        out = hvd.broadcast(x, root, **kw)
    elif call == "reducescatter":
        out = hvd.reducescatter(x, op=op, prescale_factor=pre,
                                postscale_factor=case.postscale, **kw)
    elif call == "alltoall":
        out = hvd.alltoall(x, splits, **kw)
        if splits is not None:
            out, received = out
            _check_received(case, ctx, None, np.asarray(received).tolist())
    else:
        raise AssertionError(call)
    outs = out if isinstance(out, list) else [out]
    return [np.asarray(o) for o in outs], [np.asarray(x) for x in xs]


@fuzz_settings(150)
@given(case=fz.cases(POOLS, api="torch"))
def test_torch_api(pools, case):
    pytest.importorskip("torch")
    _run_case(pools, case, _torch_call)


@fuzz_settings(60)
@given(case=fz.cases(POOLS, api="tf"))
def test_tensorflow_api(pools, case):
    pytest.importorskip("tensorflow")
    _run_case(pools, case, _tf_call)


@example(case=_case(api="jax", call="reducescatter", dtype="float32", shapes=((4,), (4,)),
                    layout="array", name="fz.odd", odd=fz.Odd(0, "op", "Min")))  # hung
@fuzz_settings(60)
@given(case=fz.cases(POOLS, api="jax"))
def test_jax_api(pools, case):
    pytest.importorskip("jax")
    _run_case(pools, case, _jax_call)


def _reuse_after_completion(comm):
    """The name of an async allreduce that completed (but was not synchronized) is still
    taken: every rank refuses it again, whatever the timing, and the first returns."""
    x = np.arange(4, dtype=np.float64) + comm.rank()
    first = comm.allreduce_async(x, rs.Sum, name="fz.reused")
    while not comm.poll(first):  # (completed on this rank; the engine forgot the name)
        time.sleep(0.001)
    with pytest.raises(UsageError, match="'fz.reused' is already in flight"):
        comm.allreduce_async(x, rs.Sum, name="fz.reused")
    got = comm.synchronize(first)
    want = sum(np.arange(4, dtype=np.float64) + r for r in range(comm.size()))
    assert np.array_equal(got, want), (got, want)
    again = comm.synchronize(comm.allreduce_async(x, rs.Sum, name="fz.reused"))
    assert np.array_equal(again, want), (again, want)


def test_a_name_is_taken_until_synchronized():
    """Found by the fuzzing: a rank whose first call had completed accepted the name
    again, alone, and waited for peers that had refused it (a stall, then a broken ring)."""
    assert_ranks_ok(_reuse_after_completion, 3, timeout=DEADLINE_S, env=ENV)
