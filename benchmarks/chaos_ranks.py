"""Rank side of benchmarks/chaos.py: one elastic training job whose ranks inject the faults
of a plan, and leave a record of how they ended.

The plan (RINGSYNC_CHAOS_PLAN, JSON) names the workload and the faults; each fault has a
kind, the original rank it strikes and the step (counted in steps run, rolled-back steps
included, so that a fault fires once). Faults the rank injects itself, at the point the
kind names:

    kill-allreduce    SIGKILL after backward: the step's gradient reductions are in flight
    kill-negotiation  SIGKILL from a timer a few hundred microseconds into step(): whatever
                      the engine is doing then (negotiating, reducing, completing)
    kill-commit       SIGKILL inside State.commit(), after this rank's snapshot
    kill-checkpoint   SIGKILL inside the checkpoint save, at a point the plan draws
                      (before or after this rank's part, or, on rank 0, before the
                      generation's meta.json or before checkpoint.json names it)
    stop              SIGSTOP for `seconds`, then SIGCONT (from a child process): a straggler
    exception         an uncaught RuntimeError in the training function
    shm-full          fill /dev/shm (a private tmpfs the driver mounts), then SIGKILL one
                      step later: the survivors rebuild without room for shared memory

Every process writes RINGSYNC_CHAOS_DIR/end-<original rank>.json when it finishes or fails
(its parameters, the ring sizes of the steps as finally run, the replay's error, whether
the latest checkpoint loads and holds what was saved; or the error's type and text), and
pid-<original rank> at the start, for the driver's leftover check, and training-<original
rank> at its first step.

Workloads: "torch" (DistributedOptimizer + TorchState, SGD with momentum, float64),
"sharded" (ShardedOptimizer stage 2: state in checkpoints, rebuilt for the new ring size
after a recovery from the latest checkpoint, as sharded state needs today) and "keras"
(model.fit with Horovod's elastic Keras callbacks).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

STEPS = 14
COMMIT_EVERY = 3
BATCH = 6
ROWS = 256
KERAS_EPOCHS, KERAS_STEPS = 3, 5


class Plan:
    def __init__(self, text: str):
        plan = json.loads(text)
        self.workload = plan["workload"]
        self.faults = plan["faults"]
        self.folder = os.environ["RINGSYNC_CHAOS_DIR"]
        self.me = original_rank()
        self.steps_seen = 0  # steps started by this process, rolled-back ones included
        self.fired = set()

    def due(self, kind: str):
        """This process's fault of `kind` if its step has come and it has not fired yet
        (marked fired now): a fault fires once, at the first chance from its step on."""
        for i, f in enumerate(self.faults):
            if f["kind"] == kind and f["rank"] == self.me and f["step"] <= self.steps_seen \
                    and i not in self.fired:
                self.fired.add(i)
                return f
        return None

    def at_step_start(self):
        """Faults that strike at the start of a step (stop, exception, shm-full)."""
        if self.steps_seen == 0:  # (the driver's link-flap waits for every rank's)
            self.write(f"training-{self.me}", {"time": time.time()})
        stop = self.due("stop")
        if stop:
            straggle(stop["seconds"])
        if self.due("exception"):
            raise RuntimeError(f"chaos: a bug on rank {self.me} at step {self.steps_seen}")
        if self.due("shm-full"):
            fill_shared_memory()
            self.faults.append({"kind": "kill-after-shm", "rank": self.me,
                                "step": self.steps_seen + 1})
        if self.due("kill-after-shm"):
            die(self, "one step after filling /dev/shm")

    def write(self, name: str, record: dict):
        path = os.path.join(self.folder, name)
        with open(path + ".partial", "w") as f:
            json.dump(record, f)
        os.replace(path + ".partial", path)


def original_rank() -> int:
    for name in ("OMPI_COMM_WORLD_RANK", "RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return -1


def die(plan: Plan, where: str):
    plan.write(f"killed-{plan.me}.json", {"where": where, "step": plan.steps_seen})
    os.kill(os.getpid(), signal.SIGKILL)


def straggle(seconds: float):
    """Stop this process; a child wakes it after `seconds`."""
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"],
                     start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def fill_shared_memory():
    """Write /dev/shm/chaos-filler until the file system is full."""
    with open("/dev/shm/chaos-filler", "wb") as f:
        block = b"\0" * (1 << 20)
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError:
            pass


def kill_timer(plan: Plan):
    """kill-negotiation: a timer that SIGKILLs this process shortly after it starts."""
    fault = plan.due("kill-negotiation")
    if not fault:
        return None
    timer = threading.Timer(fault["delay_us"] / 1e6, die, (plan, "inside step()"))
    timer.daemon = True
    timer.start()
    return timer


def killing_checkpoint_writes(plan: Plan):
    """kill-checkpoint: replace the checkpoint's file writer with one that dies at the
    drawn point of this rank's save."""
    fault = plan.due("kill-checkpoint")
    import ringsync.torch.checkpoint as ckpt
    if not hasattr(ckpt, "_chaos_write"):
        ckpt._chaos_write = ckpt._write_atomically
    if not fault:
        ckpt._write_atomically = ckpt._chaos_write
        return
    # "before-part", "after-part"; rank 0 also "before-meta" (the generation's own
    # meta.json) and "before-name" (checkpoint.json, which names the generation)
    point = fault["point"]
    befores = {"before-part": ".pt", "before-meta": "meta.json", "before-name": "checkpoint.json"}

    def write(path, data):
        if point in befores and path.endswith(befores[point]):
            die(plan, f"checkpoint save, {point}")
        ckpt._chaos_write(path, data)
        if point == "after-part" and path.endswith(".pt"):
            die(plan, f"checkpoint save, {point}")
    ckpt._write_atomically = write


# ------------------------------------------------------------------------ torch workloads

def torch_data():
    import torch
    g = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return x, y


def torch_model(seed: int):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def rows(step: int, size: int, rank: int):
    """Rank `rank` of `size`'s rows at `step`; all ranks' rows are the global batch."""
    start = (step * 29) % ROWS
    batch = [(start + i) % ROWS for i in range(BATCH * size)]
    return batch[rank * BATCH:(rank + 1) * BATCH]


def torch_reference(sizes, optimizer_class):
    """One process replaying the global batches of the steps as they were finally run."""
    import torch
    x, y = torch_data()
    model = torch_model(100)  # rank 0's initial parameters, which sync() gives everyone
    opt = optimizer_class(model.parameters())
    for step, size in enumerate(sizes):
        batch = sum((rows(step, size, r) for r in range(size)), [])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def sgd(params):
    import torch
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    import torch
    return torch.optim.Adam(params, lr=0.01)


def torch_step(plan, hvd, model, opt, x, y, state):
    import torch
    plan.at_step_start()
    batch = rows(state.step, hvd.size(), hvd.rank())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
    if plan.due("kill-allreduce"):
        die(plan, f"after backward at step {state.step}")
    timer = kill_timer(plan)
    opt.step()
    if timer:
        timer.join()  # (it kills this process)


def killing_commits(state, plan: Plan):
    """state, whose commit() now dies after this rank's snapshot when the plan says (on
    the instance: KerasState is a factory, not a class to derive from)."""
    commit = state.commit

    def commit_then_maybe_die():
        commit()
        if plan.due("kill-commit"):
            die(plan, "inside commit")
    state.commit = commit_then_maybe_die
    return state


def torch_training(plan: Plan):
    import ringsync.torch as hvd
    hvd.init()
    x, y = torch_data()
    model = torch_model(100 + plan.me)  # differs until the state syncs
    opt = hvd.DistributedOptimizer(sgd(model.parameters()),
                                   named_parameters=model.named_parameters())

    state = killing_commits(hvd.elastic.TorchState(model, opt, step=0, sizes=[]), plan)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            torch_step(plan, hvd, model, opt, x, y, state)
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            plan.steps_seen += 1
            if state.step % COMMIT_EVERY == 0:
                killing_checkpoint_writes(plan)
                hvd.checkpoint.save(checkpoint_dir(plan), model, opt, step=state.step,
                                    sizes=state.sizes)
                state.commit()

    train(state)
    finish_torch(plan, hvd, model, opt, state.sizes, sgd, resets)


def sharded_training(plan: Plan):
    """ShardedOptimizer stage 2: its state is spread over the ranks, so a lost rank's
    piece exists only in the checkpoints; after a recovery every rank rebuilds the
    optimizer for the new ring and loads the latest checkpoint (N -> N-1 ranks)."""
    import ringsync.torch as hvd
    hvd.init()
    x, y = torch_data()
    model = torch_model(100)
    held = {}

    def build():
        held["opt"] = hvd.ShardedOptimizer(adam(model.parameters()),
                                           named_parameters=model.named_parameters(), stage=2)

    def reload():
        build()
        extra = hvd.checkpoint.load(checkpoint_dir(plan), model, held["opt"])
        state.step, state.sizes = extra["step"], list(extra["sizes"])

    build()
    state = killing_commits(hvd.elastic.ObjectState(step=0, sizes=[]), plan)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        if resets:
            reload()
        while state.step < STEPS:
            torch_step(plan, hvd, model, held["opt"], x, y, state)
            state.sizes = state.sizes + [hvd.size()]
            state.step += 1
            plan.steps_seen += 1
            if state.step % COMMIT_EVERY == 0:
                killing_checkpoint_writes(plan)
                hvd.checkpoint.save(checkpoint_dir(plan), model, held["opt"],
                                    step=state.step, sizes=state.sizes)
                state.commit()

    hvd.checkpoint.save(checkpoint_dir(plan), model, held["opt"], step=0, sizes=[])
    train(state)
    finish_torch(plan, hvd, model, held["opt"], state.sizes, adam, resets)


def checkpoint_dir(plan: Plan) -> str:
    return os.path.join(plan.folder, "checkpoint")


def finish_torch(plan, hvd, model, opt, sizes, optimizer_class, resets):
    params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    reference = torch_reference(sizes, optimizer_class)
    error = max(abs(a - b) for pa, pb in zip(params, reference) for a, b in zip(pa, pb))
    loaded = latest_checkpoint_holds(plan, hvd, model, opt, sizes)
    plan.write(f"end-{plan.me}.json", {
        "outcome": "finished", "rank": hvd.rank(), "size": hvd.size(), "params": params,
        "sizes": sizes, "replay_error": error, "resets": resets, "checkpoint": loaded})
    hvd.shutdown()


def latest_checkpoint_holds(plan, hvd, model, opt, sizes):
    """Load the newest checkpoint into a fresh model: it must load, and hold the
    parameters of the replay of the steps it says it saved."""
    fresh = torch_model(999)
    try:
        extra = hvd.checkpoint.load(checkpoint_dir(plan), fresh)
    except Exception as e:  # (any failure to load is what this check reports)
        return f"the latest checkpoint does not load: {type(e).__name__}: {e}"
    optimizer_class = sgd if plan.workload == "torch" else adam
    reference = torch_reference(list(extra["sizes"]), optimizer_class)
    got = [p.detach().reshape(-1).tolist() for p in fresh.parameters()]
    error = max(abs(a - b) for pa, pb in zip(got, reference) for a, b in zip(pa, pb))
    return "ok" if error < 1e-9 else f"the latest checkpoint differs from its replay by {error}"


# ------------------------------------------------------------------------------- Keras

def keras_training(plan: Plan):
    """Horovod's elastic Keras recipe (model.fit inside hvd.elastic.run with the state
    callbacks). fit decides the batches after a recovery, so the check is that the
    survivors agree exactly and the model learned (no replay)."""
    import keras
    import ringsync.tensorflow.keras as hvd
    hvd.init()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4 * 8 * KERAS_STEPS, 6)).astype("float32")
    y = ((x[:, :3].sum(1) > 0).astype("int64") + (x[:, 3] > 1)).astype("int64")
    keras.utils.set_random_seed(100 + plan.me)  # differs until the state syncs
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = killing_commits(hvd.elastic.KerasState(model, batch=0, epoch=0), plan)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    class Faults(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            plan.at_step_start()
            if plan.due("kill-allreduce"):  # (fit's train step hides its reductions)
                die(plan, f"at the start of batch {batch}")
            kill_timer(plan)

        def on_train_batch_end(self, batch, logs=None):
            plan.steps_seen += 1

    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state), Faults()]

    @hvd.elastic.run
    def train(state):
        mine = slice(hvd.rank(), None, hvd.size())
        model.fit(x[mine], y[mine], batch_size=8, steps_per_epoch=KERAS_STEPS,
                  epochs=KERAS_EPOCHS - state.epoch, callbacks=callbacks, verbose=0,
                  shuffle=False)

    train(state)
    params = [v.numpy().reshape(-1).tolist() for v in model.variables]
    loss = float(model.evaluate(x, y, verbose=0))
    plan.write(f"end-{plan.me}.json", {
        "outcome": "finished", "rank": hvd.rank(), "size": hvd.size(), "params": params,
        "epoch": state.epoch, "resets": resets, "loss": loss,
        "replay_error": 0.0 if np.isfinite(loss) and state.epoch == KERAS_EPOCHS else
        f"epoch {state.epoch}, loss {loss}", "checkpoint": "ok"})
    hvd.shutdown()


WORKLOADS = {"torch": torch_training, "sharded": sharded_training, "keras": keras_training}


def main():
    plan = Plan(os.environ["RINGSYNC_CHAOS_PLAN"])
    plan.write(f"pid-{plan.me}", {"pid": os.getpid()})
    try:
        WORKLOADS[plan.workload](plan)
    except BaseException as e:
        plan.write(f"end-{plan.me}.json", {"outcome": "error", "type": type(e).__name__,
                                           "text": str(e)[:2000],
                                           "trace": traceback.format_exc()[-4000:]})
        raise


if __name__ == "__main__":
    sys.exit(main())
