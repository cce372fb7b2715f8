"""Elastic recovery under Open MPI's ULFM: ranks SIGKILLed at chosen points, the
survivors (and replacements) finish with identical state equal to a reference replay
of the steps as they were finally run, and nothing of the job is left running.

These tests watch the job from outside (ranks killed on purpose, the job's output,
processes left running), so each starts it with run_mpi; the rank code is the
module-level function it passes (numpy_training, torch_training, sampler_coverage,
keras_training), placed just before the tests that run it.

Every process writes one JSON record to RINGSYNC_TEST_DIR when it finishes, so the test
can compare the survivors with each other and with a reference. Faults are injected by
the processes themselves (SIGKILL at a chosen step), chosen by original MPI rank. The
`marker` argument only tags the command line, so that a test can look for leftovers.
"""
import copy
import glob
import json
import os
import signal
import time

import numpy as np
import pytest

import ringsync as rs
from ringsync import elastic
from ringsync.testing import run_mpi

pytestmark = pytest.mark.requires_mpirun

ULFM = ("--with-ft", "ulfm")
TIMEOUT = 120


def run_job(tmp_path, body, np, args=(), mpirun_args=ULFM, hosts=None, slots=1, **env):
    marker = f"ringsync-elastic-{os.getpid()}-{tmp_path.name}"
    settings = {"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TIMEOUT_SECONDS": "60"}
    settings.update({name: str(value) for name, value in env.items()})
    result = run_mpi(body, np=np, timeout=TIMEOUT, args=tuple(args) + (marker,),
                     mpirun_args=mpirun_args, env=settings, hosts=hosts, slots=slots)
    assert not result.timed_out, result.report()
    assert not result.leftover_pids, f"processes left running: {result.leftover_pids}\n" + result.report()
    records = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "result-*.json")))]
    return result, records


def assert_survivors_agree(result, records, expected_size):
    assert result.returncode == 0, result.report()
    assert len(records) == expected_size, result.report()
    assert sorted(r["rank"] for r in records) == list(range(expected_size)), records
    assert all(r["size"] == expected_size for r in records), records


def assert_numpy_run(result, records, expected_size, lost_at_or_before):
    assert_survivors_agree(result, records, expected_size)
    for r in records:
        assert r["w"] == records[0]["w"], "parameters differ between survivors"
        assert r["w"] == pytest.approx(r["reference"], rel=1e-12, abs=1e-12), r
        assert r["restores"] == records[0]["restores"], "survivors restored different commits"
        sizes = r["sizes"]
        assert len(sizes) == STEPS
        changed = sizes.index(expected_size)
        assert changed <= lost_at_or_before and set(sizes[changed:]) == {expected_size}, sizes
    redone = max(r["steps_run"] for r in records) - STEPS
    assert 0 <= redone <= COMMIT_EVERY, f"{redone} steps redone"


# ---------------------------------------------------------- numpy, and what every body uses


STEPS = 24
COMMIT_EVERY = 4
DIM = 5


def original_rank() -> int:
    """The rank this process started with (-1 for a replacement): from MPI, or from
    RANK where a launcher without MPI started it (tests/faults/test_store_elastic.py)."""
    if os.environ.get("RINGSYNC_ELASTIC_JOIN") == "1":
        return -1
    if "RANK" in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        return int(os.environ["RANK"])
    from mpi4py import MPI
    if MPI.Comm.Get_parent() != MPI.COMM_NULL or os.environ.get("RINGSYNC_TEST_SPAWNED"):
        os.environ["RINGSYNC_TEST_SPAWNED"] = "1"
        return -1
    return MPI.COMM_WORLD.Get_rank()


def die(note: str) -> None:
    """SIGKILL this process, after leaving the time for the test's recovery figure."""
    with open(os.path.join(os.environ["RINGSYNC_TEST_DIR"], "killed-%d" % os.getpid()), "w") as f:
        json.dump({"note": note, "time": time.time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def write_record(record: dict) -> None:
    folder = os.environ["RINGSYNC_TEST_DIR"]
    path = os.path.join(folder, "result-%d.json" % os.getpid())
    with open(path + ".partial", "w") as f:
        json.dump(record, f)
    os.replace(path + ".partial", path)


def gradient(step: int, rank: int) -> np.ndarray:
    """Differs by step, rank and position; exact in float64."""
    return (rank + 1) * (step + 1) + np.arange(DIM, dtype=np.float64) * (rank - 2)


def reference(sizes) -> np.ndarray:
    """The parameters after applying step s averaged over sizes[s] ranks, for every s."""
    w = np.zeros(DIM)
    for step, size in enumerate(sizes):
        w -= 0.01 * np.mean([gradient(step, r) for r in range(size)], axis=0)
    return w


class KillableState(elastic.ObjectState):
    """ObjectState whose commit() can kill this rank halfway (after the snapshot)."""

    kill_in_commit = None

    def commit(self):
        super().commit()
        if self.kill_in_commit is not None and self.commit_id == self.kill_in_commit:
            die("in commit %d" % self.commit_id)


class HorovodStyleState(elastic.State):
    """A State subclass written for Horovod (horovod.common.elastic.State): its own save,
    restore, sync and reset, through the bcast_object it was given."""

    def __init__(self, **values):
        super().__init__(bcast_object=rs.broadcast_object, get_rank=rs.rank)
        self._keys = list(values)
        self.__dict__.update(values)
        self.resets = 0
        self.save()

    def save(self):
        self._saved = copy.deepcopy({k: getattr(self, k) for k in self._keys})

    def restore(self):
        self.__dict__.update(copy.deepcopy(self._saved))

    def sync(self):
        self._saved = self._bcast_object(self._saved, 0)
        self.restore()

    def reset(self):
        self.resets += 1


# scenario "hosts": at these steps rank 0 changes what the host discovery script prints
# (to the value of the variable named), which takes effect at the next commit.
HOST_CHANGES = {6: "RINGSYNC_TEST_HOSTS_GROWN", 14: "RINGSYNC_TEST_HOSTS_SHRUNK"}


def _offer_hosts(path: str, text: str) -> None:
    with open(path + ".partial", "w") as f:
        f.write(text.replace(",", "\n") + "\n")
    os.replace(path + ".partial", path)


def numpy_training(scenario: str = "plain", marker: str = ""):
    """SGD on a parameter vector whose gradient is allreduced every step.

    Scenarios: victims (RINGSYNC_TEST_VICTIM, comma-separated) = original ranks killed at step KILL_STEP (mid-allreduce: it submits
    its gradient first); 'commit' kills it inside commit(); 'second' also kills
    RINGSYNC_TEST_SECOND during the recovery (in a reset callback); 'exception' makes the
    victim raise instead of dying; 'hosts' changes the discovered hosts (HOST_CHANGES)."""
    me = original_rank()
    rs.init()
    victims = [int(v) for v in os.environ.get("RINGSYNC_TEST_VICTIM", "-9").split(",")]
    second = int(os.environ.get("RINGSYNC_TEST_SECOND", "-9"))
    kill_step = int(os.environ.get("RINGSYNC_TEST_KILL_STEP", "10"))
    if scenario == "horovod":
        state = HorovodStyleState(step=0, w=np.zeros(DIM), sizes=[], restores=[])
    else:
        state = KillableState(step=0, w=np.zeros(DIM), sizes=[], restores=[])
    if scenario == "commit" and me in victims:
        state.kill_in_commit = kill_step // COMMIT_EVERY
    steps_run = []
    recovered_at = []

    def on_reset():
        state.restores.append(state.commit_id)
        recovered_at.append(time.time())
        if scenario == "second" and me == second:
            die("during recovery")

    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if me in victims and state.step == kill_step and scenario != "commit":
                if scenario == "exception":
                    raise RuntimeError("a bug on rank %d" % me)
                rs.allreduce_async(gradient(state.step, rs.rank()), name="g.%d" % state.step)
                die("mid-allreduce at step %d" % state.step)
            if scenario == "hosts" and rs.rank() == 0 and state.step in HOST_CHANGES:
                _offer_hosts(os.environ["RINGSYNC_TEST_HOSTS_FILE"],
                             os.environ[HOST_CHANGES[state.step]])
            g = rs.allreduce(gradient(state.step, rs.rank()), op=rs.Average,
                             name="g.%d" % state.step)
            state.w = state.w - 0.01 * g
            state.sizes = state.sizes + [rs.size()]
            state.step += 1
            steps_run.append((state.step, time.time()))
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    write_record({"original_rank": me, "rank": rs.rank(), "size": rs.size(),
                  "w": state.w.tolist(), "reference": reference(state.sizes).tolist(),
                  "sizes": state.sizes, "restores": state.restores,
                  "steps_run": len(steps_run), "resets": getattr(state, "resets", None),
                  "first_step_after_recovery": _first_step_after(steps_run, recovered_at)})
    rs.shutdown()


def _first_step_after(steps_run, recovered_at):
    if not recovered_at:
        return None
    after = [t for _, t in steps_run if t > recovered_at[0]]
    return after[0] if after else None


@pytest.mark.parametrize("np,victim", [(4, 2), (3, 0)])
def test_a_killed_rank_leaves_the_survivors_training(np, victim, tmp_path):
    result, records = run_job(tmp_path, numpy_training, np, args=("plain",),
                              RINGSYNC_TEST_VICTIM=victim, RINGSYNC_TEST_KILL_STEP=10)
    assert_numpy_run(result, records, np - 1, lost_at_or_before=10)
    assert "ringsync.elastic: lost rank(s) [%d] of %d" % (victim, np) in result.output


def test_a_horovod_style_state_subclass_recovers_unchanged(tmp_path):
    """A user's State written for Horovod (save/restore/sync/reset) survives a kill."""
    result, records = run_job(tmp_path, numpy_training, 3, args=("horovod",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_KILL_STEP=10)
    assert_numpy_run(result, records, 2, lost_at_or_before=10)
    assert all(r["resets"] == 1 for r in records), records


def test_a_rank_killed_inside_commit(tmp_path):
    result, records = run_job(tmp_path, numpy_training, 4, args=("commit",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_KILL_STEP=12)
    assert_numpy_run(result, records, 3, lost_at_or_before=12)
    assert len(records[0]["restores"]) == 1


def test_a_second_failure_during_recovery(tmp_path):
    result, records = run_job(tmp_path, numpy_training, 4, args=("second",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_SECOND=3,
                              RINGSYNC_TEST_KILL_STEP=9)
    assert_numpy_run(result, records, 2, lost_at_or_before=9)
    assert {r["original_rank"] for r in records} == {0, 2}


def test_an_uncaught_exception_is_a_lost_rank(tmp_path):
    result, records = run_job(tmp_path, numpy_training, 3, args=("exception",),
                              RINGSYNC_TEST_VICTIM=2, RINGSYNC_TEST_KILL_STEP=7)
    assert_numpy_run(result, records, 2, lost_at_or_before=7)
    assert "RuntimeError: a bug on rank 2" in result.outcomes[2], result.report()


def test_below_min_np_the_job_ends_with_a_clear_message(tmp_path):
    result, records = run_job(tmp_path, numpy_training, 3, args=("plain",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_ELASTIC_MIN_NP=3)
    assert result.returncode != 0, result.report()
    assert records == []
    assert "only 2 rank(s) left after losing rank(s) [1]; the job needs at least 3" in result.output


def test_reset_limit_ends_the_job(tmp_path):
    (tmp_path / "none").mkdir()
    (tmp_path / "one").mkdir()
    result, records = run_job(tmp_path / "none", numpy_training, 3, args=("plain",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_ELASTIC_RESET_LIMIT=0)
    assert result.returncode == 0 and len(records) == 2, result.report()  # 0: no limit
    result, records = run_job(tmp_path / "one", numpy_training, 3, args=("second",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_SECOND=2,
                              RINGSYNC_ELASTIC_RESET_LIMIT=1)
    assert result.returncode != 0 and records == [], result.report()
    assert "reset limit reached (1 recoveries" in result.output, result.report()


def test_without_ulfm_a_lost_rank_ends_the_job(tmp_path):
    result, records = run_job(tmp_path, numpy_training, 3, args=("plain",), mpirun_args=(),
                              RINGSYNC_TEST_VICTIM=1)
    assert result.returncode != 0, result.report()
    assert records == []


# --------------------------------------------------------------------------- PyTorch


TORCH_STEPS = 16
TORCH_BATCH = 6
TORCH_ROWS = 512


def _torch_data():
    import torch
    g = torch.Generator().manual_seed(7)
    x = torch.randn(TORCH_ROWS, 6, generator=g, dtype=torch.float64)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def _torch_model(seed: int):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def _rows(step: int, size: int, rank: int):
    """The rows rank `rank` of `size` trains on at `step`; all ranks' rows together are
    the global batch the reference trains on."""
    start = (step * 37) % TORCH_ROWS
    rows = [(start + i) % TORCH_ROWS for i in range(TORCH_BATCH * size)]
    return rows[rank * TORCH_BATCH:(rank + 1) * TORCH_BATCH]


def _step_done(state, size, steps_run):
    """A training step finished: record the ring size it ran on, commit every few steps."""
    state.sizes = state.sizes + [size]
    state.step += 1
    steps_run.append(time.time())
    if state.step % COMMIT_EVERY == 0:
        state.commit()


def _max_error(params, reference):
    return max(abs(a - b) for pa, pb in zip(params, reference) for a, b in zip(pa, pb))


def _torch_reference(sizes, make_optimizer=None):
    """One process replaying the global batches of the steps as they were finally run
    (with SGD and momentum, or make_optimizer(parameters)'s optimizer)."""
    import torch
    x, y = _torch_data()
    model = _torch_model(100)  # rank 0's initial parameters, which sync() gives everyone
    opt = make_optimizer(model.parameters()) if make_optimizer else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, size in enumerate(sizes):
        rows = sum((_rows(step, size, r) for r in range(size)), [])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def _await_replacement():
    """RINGSYNC_TEST_AWAIT_JOINER=1 (a store's replacements join at a commit, whenever
    they are ready): after a loss leaves the job below its size, rank 0 holds the job
    until a replacement waits to join, so that the next commit takes it in, however
    long it takes to start."""
    from ringsync._context import resolve
    comm = resolve()
    if os.environ.get("RINGSYNC_TEST_AWAIT_JOINER") != "1" or comm.rank() != 0 or \
            comm.size() >= int(os.environ["WORLD_SIZE"]):
        return
    rendezvous = comm.rendezvous
    deadline = time.monotonic() + 120
    while rendezvous.joiners_waiting() == 0:
        assert time.monotonic() < deadline, "no replacement came to join"
        time.sleep(0.05)


def torch_training(marker: str = ""):
    """TorchState + DistributedOptimizer: victim killed mid-allreduce (its gradient
    reductions already started), RINGSYNC_ELASTIC_RESPAWN decides about replacements."""
    import torch
    import ringsync.torch as hvd
    me = original_rank()
    hvd.init()
    victims = [int(v) for v in os.environ.get("RINGSYNC_TEST_VICTIM", "-9").split(",")]
    kill_step = int(os.environ.get("RINGSYNC_TEST_KILL_STEP", "6"))
    x, y = _torch_data()
    model = _torch_model(100 + max(me, 0) if me >= 0 else 999)  # differs until sync()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, sizes=[])
    steps_run, recovered_at = [], []
    state.register_reset_callbacks([lambda: recovered_at.append(time.time()),
                                    _await_replacement])

    @hvd.elastic.run
    def train(state):
        while state.step < TORCH_STEPS:
            rows = _rows(state.step, hvd.size(), hvd.rank())
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            if me in victims and state.step == kill_step:
                die("mid-allreduce at step %d" % state.step)  # reductions are in flight
            opt.step()
            _step_done(state, hvd.size(), steps_run)

    train(state)
    params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    reference = _torch_reference(state.sizes)
    error = _max_error(params, reference)
    write_record({"original_rank": me, "rank": hvd.rank(), "size": hvd.size(),
                  "params": params, "error": error, "sizes": state.sizes,
                  "steps_run": len(steps_run), "recovered_at": recovered_at,
                  "first_step_after_recovery": _first_step_after(
                      [(0, t) for t in steps_run], recovered_at)})
    hvd.shutdown()


def test_torch_state_after_a_kill_mid_allreduce(tmp_path):
    result, records = run_job(tmp_path, torch_training, 4, RINGSYNC_TEST_VICTIM=2,
                              RINGSYNC_TEST_KILL_STEP=6)
    assert_torch_replayed(result, records, 4, 3)


def assert_torch_replayed(result, records, before, after):
    """The survivors (`after` of `before` ranks) agree, equal one process replaying the
    steps as they were run, ran the first commit interval on `before` ranks and the rest
    on `after`, and redid at most one commit interval."""
    assert_survivors_agree(result, records, after)
    for r in records:
        assert r["params"] == records[0]["params"], "parameters differ between survivors"
        assert r["error"] < 1e-10, r["error"]  # against one process replaying the steps
        assert r["sizes"][:COMMIT_EVERY] == [before] * COMMIT_EVERY and \
            set(r["sizes"][COMMIT_EVERY:]) == {after}, r["sizes"]
    redone = records[0]["steps_run"] - TORCH_STEPS
    assert 0 < redone <= COMMIT_EVERY  # rolled back to the commit before the kill


def test_respawn_returns_the_job_to_its_size(tmp_path):
    result, records = run_job(tmp_path, torch_training, 4, RINGSYNC_TEST_VICTIM=1,
                              RINGSYNC_TEST_KILL_STEP=6, RINGSYNC_ELASTIC_RESPAWN=1)
    assert_survivors_agree(result, records, 4)
    assert sorted(r["original_rank"] for r in records) == [-1, 0, 2, 3]
    for r in records:
        assert r["params"] == records[0]["params"], "the replacement differs from the survivors"
        assert r["error"] < 1e-10, r["error"]
        assert set(r["sizes"]) == {4}, r["sizes"]
    assert "3 survivors + 1 replacement(s) = 4 ranks" in result.output


def sampler_coverage(marker: str = ""):
    """One epoch of 103 samples through an ElasticSampler, 4 per batch and rank; the
    victim dies mid-epoch. Each step sums a per-sample count over ranks into the state;
    in the end every sample has been counted (rolled-back steps do not count), and only
    the padding that keeps ranks in step counts twice."""
    import torch
    import ringsync.torch as hvd
    me = original_rank()
    hvd.init()
    victims = [int(v) for v in os.environ.get("RINGSYNC_TEST_VICTIM", "-9").split(",")]
    n, batch = 103, 4
    sampler = hvd.elastic.ElasticSampler(list(range(n)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(sampler=sampler, counts=np.zeros(n), steps=0)

    @hvd.elastic.run
    def train(state):
        loader = torch.utils.data.DataLoader(list(range(n)), batch_size=batch, sampler=state.sampler)
        for batch_idx, indices in enumerate(loader):
            if me in victims and state.steps == 5:
                die("mid-epoch")
            mine = np.zeros(n)
            np.add.at(mine, indices.numpy(), 1)
            state.counts = state.counts + rs.allreduce(mine, op=rs.Sum, name="counts")
            state.sampler.record_batch(batch_idx, batch)
            state.steps += 1
            if state.steps % 3 == 0:
                state.commit()

    train(state)
    write_record({"original_rank": me, "rank": hvd.rank(), "size": hvd.size(),
                  "counts": state.counts.tolist(), "steps": state.steps})
    hvd.shutdown()


def test_elastic_sampler_covers_the_epoch_after_a_kill(tmp_path):
    result, records = run_job(tmp_path, sampler_coverage, 4, RINGSYNC_TEST_VICTIM=2)
    assert_survivors_agree(result, records, 3)
    counts = records[0]["counts"]
    assert all(r["counts"] == counts for r in records)
    assert min(counts) == 1, "a sample was never trained on"
    # Repeats only from padding: at most (ranks - 1) per reshard, two reshards here.
    assert sum(counts) - len(counts) <= 2 * 3, counts


# --------------------------------------------------------------------------- TensorFlow


def _keras_model(seed: int):
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def _keras_step(model, optimizer, x, y, tape_wrapper=None):
    import keras
    import tensorflow as tf
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))
    tape = tape_wrapper(tape) if tape_wrapper else tape
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)


def _keras_reference(sizes):
    import keras
    x, y = (t.numpy().astype("float32") for t in _torch_data())
    model = _keras_model(100)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    for step, size in enumerate(sizes):
        rows = sum((_rows(step, size, r) for r in range(size)), [])
        _keras_step(model, optimizer, x[rows], y[rows].astype("int64"))
    return [v.numpy().reshape(-1).tolist() for v in model.trainable_variables]


def keras_training(marker: str = ""):
    """TensorFlowKerasState + DistributedGradientTape; the victim dies mid-step."""
    import keras
    import ringsync.tensorflow as hvd
    me = original_rank()
    hvd.init()
    victims = [int(v) for v in os.environ.get("RINGSYNC_TEST_VICTIM", "-9").split(",")]
    kill_step = int(os.environ.get("RINGSYNC_TEST_KILL_STEP", "6"))
    x, y = (t.numpy().astype("float32") for t in _torch_data())
    model = _keras_model(100 + me if me >= 0 else 999)  # differs until sync()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0, sizes=[])
    steps_run = []

    @hvd.elastic.run
    def train(state):
        while state.step < TORCH_STEPS:
            if me in victims and state.step == kill_step:
                die("at step %d" % state.step)
            rows = _rows(state.step, hvd.size(), hvd.rank())
            _keras_step(model, optimizer, x[rows], y[rows].astype("int64"),
                        hvd.DistributedGradientTape)
            _step_done(state, hvd.size(), steps_run)

    train(state)
    params = [v.numpy().reshape(-1).tolist() for v in model.trainable_variables]
    reference = _keras_reference(state.sizes)
    error = _max_error(params, reference)
    write_record({"original_rank": me, "rank": hvd.rank(), "size": hvd.size(),
                  "params": params, "error": error, "sizes": state.sizes,
                  "steps_run": len(steps_run)})
    hvd.shutdown()


def test_keras_state_after_a_kill(tmp_path):
    result, records = run_job(tmp_path, keras_training, 3, RINGSYNC_TEST_VICTIM=1,
                              RINGSYNC_TEST_KILL_STEP=6)
    assert_survivors_agree(result, records, 2)
    for r in records:
        assert r["params"] == records[0]["params"], "weights differ between survivors"
        assert r["error"] < 1e-5, r["error"]  # float32, against one process replaying
        assert r["sizes"][:4] == [3] * 4 and set(r["sizes"][4:]) == {2}, r["sizes"]


KERAS_EPOCHS = 3
KERAS_STEPS = 6  # batches per epoch on every rank


def keras_fit_training(marker: str = ""):
    """Horovod's elastic Keras recipe, as its example writes it: model.fit with the
    DistributedOptimizer, KerasState and the three state callbacks inside
    hvd.elastic.run; the victim dies at the start of a chosen batch."""
    import keras
    import ringsync.tensorflow.keras as hvd
    me = original_rank()
    hvd.init()
    victims = [int(v) for v in os.environ.get("RINGSYNC_TEST_VICTIM", "-9").split(",")]
    kill_batch = int(os.environ.get("RINGSYNC_TEST_KILL_STEP", "8"))
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3 * 8 * KERAS_STEPS, 6)).astype("float32")
    y = ((x[:, :3].sum(1) > 0).astype("int64") + (x[:, 3] > 1)).astype("int64")
    model = _keras_model(100 + me if me >= 0 else 999)  # differs until the state syncs
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    batches = [0]

    class KillAt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            batches[0] += 1
            if me in victims and batches[0] == kill_batch:
                die("at batch %d" % batches[0])

    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state), KillAt()]

    @hvd.elastic.run
    def train(state):
        mine = slice(hvd.rank(), None, hvd.size())
        model.fit(x[mine], y[mine], batch_size=8, steps_per_epoch=KERAS_STEPS,
                  epochs=KERAS_EPOCHS - state.epoch, callbacks=callbacks, verbose=0,
                  shuffle=False)

    train(state)
    params = [v.numpy().reshape(-1).tolist() for v in model.variables]
    optimizer = [np.asarray(v).reshape(-1).tolist() for v in model.optimizer.variables]
    write_record({"original_rank": me, "rank": hvd.rank(), "size": hvd.size(),
                  "params": params, "optimizer": optimizer, "epoch": state.epoch,
                  "resets": resets, "loss": float(model.evaluate(x, y, verbose=0))})
    hvd.shutdown()


def test_keras_fit_survives_a_kill(tmp_path):
    result, records = run_job(tmp_path, keras_fit_training, 3, RINGSYNC_TEST_VICTIM=1,
                              RINGSYNC_TEST_KILL_STEP=8)
    assert_survivors_agree(result, records, 2)
    for r in records:
        assert r["params"] == records[0]["params"], "weights differ between survivors"
        assert r["optimizer"] == records[0]["optimizer"], "optimizer states differ"
        assert r["epoch"] == KERAS_EPOCHS and r["resets"] == [2], r
        assert np.isfinite(r["loss"]) and r["loss"] < 1.0, r["loss"]


# ------------------------------------------------------------------------------------ JAX


def _jax_setup(seed: int):
    """float64 data (the torch tests' rows, from numpy), a small MLP's parameters, a loss."""
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    rng = np.random.default_rng(7)
    x = rng.normal(size=(TORCH_ROWS, 6))
    y = ((x[:, :3].sum(1) > 0).astype(np.int32) + (x[:, 3] > 1)).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {"w1": jax.random.normal(k1, (6, 8)) * 0.5, "b1": jnp.zeros(8),
              "w2": jax.random.normal(k2, (8, 3)) * 0.5, "b2": jnp.zeros(3)}

    def loss(p, x, y):
        logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])

    return x, y, params, loss


def _jax_step(tx, loss):
    import jax
    import optax

    @jax.jit
    def step(params, opt_state, x, y):
        updates, opt_state = tx.update(jax.grad(loss)(params, x, y), opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def jax_training(marker: str = ""):
    """JaxState (parameters and optax state as pytrees) + DistributedOptimizer in a jitted
    step; the victim dies at the start of a chosen step."""
    import jax
    import optax
    import ringsync.jax as hvd
    me = original_rank()
    hvd.init()
    victims = [int(v) for v in os.environ.get("RINGSYNC_TEST_VICTIM", "-9").split(",")]
    kill_step = int(os.environ.get("RINGSYNC_TEST_KILL_STEP", "6"))
    x, y, params, loss = _jax_setup(100 + me if me >= 0 else 999)  # differs until sync()
    tx = hvd.DistributedOptimizer(optax.sgd(0.1, momentum=0.9))
    state = hvd.elastic.JaxState(params=params, opt_state=tx.init(params), step=0, sizes=[])
    step, steps_run = _jax_step(tx, loss), []

    @hvd.elastic.run
    def train(state):
        while state.step < TORCH_STEPS:
            if me in victims and state.step == kill_step:
                die("at step %d" % state.step)
            rows = _rows(state.step, hvd.size(), hvd.rank())
            state.params, state.opt_state = jax.block_until_ready(
                step(state.params, state.opt_state, x[rows], y[rows]))
            _step_done(state, hvd.size(), steps_run)

    train(state)
    # One process replaying the global batches of the steps as they were finally run.
    reference = _jax_setup(100)[2]
    sgd = optax.sgd(0.1, momentum=0.9)
    replay, opt_state = _jax_step(sgd, loss), sgd.init(reference)
    for i, size in enumerate(state.sizes):
        rows = sum((_rows(i, size, r) for r in range(size)), [])
        reference, opt_state = replay(reference, opt_state, x[rows], y[rows])
    flat = [np.asarray(v).reshape(-1).tolist() for v in jax.tree.leaves(state.params)]
    error = _max_error(flat, [np.asarray(v).reshape(-1).tolist()
                              for v in jax.tree.leaves(reference)])
    write_record({"original_rank": me, "rank": hvd.rank(), "size": hvd.size(),
                  "params": flat, "error": error, "sizes": state.sizes,
                  "steps_run": len(steps_run)})
    hvd.shutdown()


def test_jax_state_after_a_kill(tmp_path):
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    result, records = run_job(tmp_path, jax_training, 3, RINGSYNC_TEST_VICTIM=1,
                              RINGSYNC_TEST_KILL_STEP=6, JAX_PLATFORMS="cpu")
    assert_survivors_agree(result, records, 2)
    for r in records:
        assert r["params"] == records[0]["params"], "parameters differ between survivors"
        assert r["error"] < 1e-10, r["error"]  # float64, against one process replaying
        assert r["sizes"][:4] == [3] * 4 and set(r["sizes"][4:]) == {2}, r["sizes"]


# --------------------------------------------------------------------------- the example


def test_elastic_torch_example_survives_a_kill():
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "elastic_torch.py")
    result = run_mpi(os.path.abspath(example), np=3, timeout=300, mpirun_args=ULFM,
                     args=("--kill", "1:20", "--check", "--epochs", "8"))
    assert not result.timed_out and not result.leftover_pids, result.report()
    assert result.returncode == 0, result.report()
    assert result.outcomes == {0: "ok", 1: "missing", 2: "ok"}, result.report()
    assert "lost rank(s) [1] of 3; 2 survivors = 2 ranks" in result.output
    assert "test accuracy on 2 ranks" in result.output
