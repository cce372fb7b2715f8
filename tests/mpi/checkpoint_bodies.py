"""ringsync.checkpoint under mpirun: saved on one rank count, loaded on another, training
goes on exactly as an uninterrupted run; a rank killed mid-save leaves the previous
checkpoint loadable; damaged checkpoints are refused with the file named, on every rank
(also when only one rank sees the damage), and the previous generation then loads.

Each step trains on a global batch of 12 rows drawn from the step number; rank r of N
takes rows [12r/N, 12(r+1)/N), so the averaged gradient is the full batch's whatever N is,
and the reference is one process (no ringsync) on the full batch."""
import os
import shutil
import signal

import torch

import ringsync.torch.checkpoint as checkpoint
import ringsync.torch as hvd
from ringsync._atomic import temporary_path

BATCH = 12
CONFIGS = ["plain", "stage1", "stage2", "stage3"]


class _Model(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(13, 31).double()
        self.l2 = torch.nn.Linear(31, 5).double()
        self.register_buffer("forwards", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.forwards += 1
        return self.l2(torch.tanh(self.l1(x)))


def _batch(step, rank, size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 13, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, 5, generator=g, dtype=torch.float64)
    lo, hi = BATCH * rank // size, BATCH * (rank + 1) // size
    return x[lo:hi], y[lo:hi]


def _build(config, seed):
    """(model as trained, optimizer) for a config; seed: the initial parameters."""
    model = _Model(seed)
    if config == "stage3":
        model = hvd.ShardedModule(model)
        return model, hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.02),
                                           stage=3)
    base = torch.optim.Adam(model.parameters(), lr=0.02)
    if config == "plain":
        return model, hvd.DistributedOptimizer(base, model.named_parameters())
    # (small buckets: a rank owns several pieces of each group, one per bucket)
    return model, hvd.ShardedOptimizer(base, stage=int(config[-1]), bucket_cap_mb=2e-3)


def _train(model, opt, first, last):
    for step in range(first, last):
        x, y = _batch(step, hvd.rank(), hvd.size())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _reference(steps):
    model = _Model(seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for step in range(steps):
        x, y = _batch(step, 0, 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def _compare(model, ref, what):
    if isinstance(model, hvd.ShardedModule):
        with model.gathered_parameters() as full:
            return _compare(full, ref, what)
    expected = ref.state_dict()
    for name, value in model.state_dict().items():
        want = expected[name]
        err = (value - want).abs().max().item() / max(want.abs().max().item(), 1e-300)
        assert err <= 1e-10, f"{what}: {name} differs from the uninterrupted run by {err:.3g}"


def save_after(path, steps):
    """Train every config `steps` steps from seed 5 and save each to path/<config>."""
    hvd.init()
    for config in CONFIGS:
        model, opt = _build(config, seed=5)
        _train(model, opt, 0, int(steps))
        generation = checkpoint.save(os.path.join(path, config), model, opt, step=int(steps),
                                     note=f"saved on {hvd.size()} ranks")
        assert generation == 1, generation
    hvd.shutdown()


def resume(path, total):
    """Load each config (built from another seed) and train on to `total` steps: the same
    parameters as one process that trained `total` steps without stopping."""
    hvd.init()
    total = int(total)
    for config in CONFIGS:
        model, opt = _build(config, seed=123)
        extra = checkpoint.load(os.path.join(path, config), model, opt)
        first = extra["step"]
        assert 0 < first < total and extra["note"].startswith("saved on"), extra
        _compare(model, _reference(first), f"{config} just loaded on {hvd.size()} ranks")
        _train(model, opt, first, total)
        _compare(model, _reference(total), f"{config} loaded on {hvd.size()} ranks")
    # A stage-3 checkpoint into the plain module, and a plain one into a ShardedModule.
    plain = _Model(seed=7)
    first = checkpoint.load(os.path.join(path, "stage3"), plain)["step"]
    _compare(plain, _reference(first), "stage 3 checkpoint into a plain module")
    sharded = hvd.ShardedModule(_Model(seed=8))
    checkpoint.load(os.path.join(path, "plain"), sharded)
    _compare(sharded, _reference(first), "plain checkpoint into a ShardedModule")
    hvd.shutdown()


def save_then_die_saving(path, steps):
    """Save after `steps` steps, train one more, and save again; rank 1 is SIGKILLed in
    the middle of writing its part of the second save."""
    hvd.init()
    model, opt = _build("stage2", seed=5)
    _train(model, opt, 0, int(steps))
    checkpoint.save(path, model, opt, step=int(steps))
    _train(model, opt, int(steps), int(steps) + 1)
    if hvd.rank() == 1:
        def write_half_then_die(target, data):
            with open(temporary_path(target), "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint._write_atomically = write_half_then_die
    checkpoint.save(path, model, opt, step=int(steps) + 1)
    raise AssertionError("the save with a killed rank returned")


def damage_one_rank_sees(path):
    """Two saves (steps 2 and 3); rank 1 then loads from its own copy of the folder, in
    which one byte of rank 0's newest part is flipped (as if the ranks saw different bytes
    of a shared file system): both ranks raise the same CheckpointError, which names rank
    1's file and generation 1 as intact; loading generation 1 then works on both, and
    training goes on from it exactly."""
    hvd.init()
    me = hvd.rank()
    model, opt = _build("stage2", seed=5)
    _train(model, opt, 0, 2)
    assert checkpoint.save(path, model, opt, step=2) == 1
    _train(model, opt, 2, 3)
    assert checkpoint.save(path, model, opt, step=3) == 2
    mine = path if me == 0 else f"{path}-rank-1"
    if me == 1:
        shutil.copytree(path, mine)
        damaged = os.path.join(mine, "gen-2", f"rank-0-of-{hvd.size()}.pt")
        data = bytearray(open(damaged, "rb").read())
        data[len(data) // 3] ^= 0x04
        open(damaged, "wb").write(bytes(data))
    hvd.barrier()
    model, opt = _build("stage2", seed=9)
    try:
        checkpoint.load(mine, model, opt)
    except checkpoint.CheckpointError as e:
        message = str(e)
    else:
        raise AssertionError(f"rank {me} loaded a checkpoint rank 1 found damaged")
    messages = hvd.allgather_object(message)
    assert messages[0] == messages[1], messages
    damaged = os.path.join(f"{path}-rank-1", "gen-2", f"rank-0-of-{hvd.size()}.pt")
    for words in (f"{damaged} does not match its SHA-256", "(on rank 1)",
                  "generation 1 is intact: load(..., generation=1)"):
        assert words in message, (words, message)
    extra = checkpoint.load(mine, model, opt, generation=1)
    assert extra["step"] == 2, extra
    _compare(model, _reference(2), "generation 1, loaded after the damaged generation 2")
    _train(model, opt, 2, 4)
    _compare(model, _reference(4), "training on from generation 1")
    hvd.shutdown()


def load_the_survivor(path, total):
    """After the killed save: the previous checkpoint loads and training goes on as if
    nothing had happened."""
    hvd.init()
    model, opt = _build("stage2", seed=123)
    extra = checkpoint.load(path, model, opt)
    _compare(model, _reference(extra["step"]), "the checkpoint before the killed save")
    _train(model, opt, extra["step"], int(total))
    _compare(model, _reference(int(total)), "training on from it")
    hvd.shutdown()


def damaged_checkpoints(path):
    """Damaged or forged checkpoints raise CheckpointError naming the problem; nothing is
    loaded wrong, and a good save afterwards works."""
    hvd.init()
    me = hvd.rank()
    model, opt = _build("stage1", seed=5)
    _train(model, opt, 0, 2)
    checkpoint.save(path, model, opt, step=2)
    meta = os.path.join(path, checkpoint.META)
    part = os.path.join(path, "gen-1", f"rank-0-of-{hvd.size()}.pt")
    good_meta, good_part = open(meta, "rb").read(), open(part, "rb").read()
    hvd.barrier()

    def expect(words):
        hvd.barrier()
        try:
            checkpoint.load(path, *_build("stage1", seed=9))
        except checkpoint.CheckpointError as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"a damaged checkpoint loaded ({words})")
        hvd.barrier()
        if me == 0:  # (repaired for the next case)
            open(meta, "wb").write(good_meta)
            open(part, "wb").write(good_part)

    if me == 0:
        open(part, "wb").write(good_part[: len(good_part) // 2])
    expect("bytes")
    if me == 0:
        open(meta, "w").write('{"format": 1, "generation": "../..", "ranks": 2}')
    expect("'generation' is '../..', not an integer")
    if me == 0:
        open(part, "wb").write(b"x" * len(good_part))
    expect(f"{part} does not match its SHA-256")
    if me == 0:  # (the same bytes, with checkpoint.json edited to fit them)
        open(part, "wb").write(b"x" * len(good_part))
        _resize_in_meta(meta, part)
    expect("cannot be read")
    if me == 0:
        forged = torch.load(part, weights_only=True)  # (not mmap: the file is rewritten)
        key = next(iter(forged["pieces"]))
        forged["pieces"][key][0]["b"] += 1 << 40
        torch.save(forged, part)
        _resize_in_meta(meta, part)
    expect("out of [0,")
    if me == 0:
        os.remove(meta)
    expect("no checkpoint")
    # a different model is refused by name
    hvd.barrier()
    wide = hvd.ShardedModule(torch.nn.Linear(13, 32).double())
    try:
        checkpoint.load(path, wide)
    except (checkpoint.CheckpointError, RuntimeError) as e:
        assert "model" in str(e) or "size" in str(e), str(e)
    else:
        raise AssertionError("a checkpoint of another model loaded")
    # An extra value that cannot be saved (rank 0 writes the extras): every rank raises,
    # none waits for rank 0 until the timeout, and the next save works.
    try:
        checkpoint.save(path, model, opt, step=3, hook=lambda: None)
    except checkpoint.CheckpointError as e:
        assert "rank 0 could not write its part" in str(e), str(e)
    else:
        raise AssertionError("an unpicklable extra was saved")
    assert checkpoint.save(path, model, opt, step=3) == 3
    assert checkpoint.load(path, *_build("stage1", seed=9))["step"] == 3
    # (the failed save's gen-2 removed; gen-1, the newest complete one before, kept)
    assert sorted(os.listdir(path)) == ["checkpoint.json", "gen-1", "gen-3"], os.listdir(path)
    hvd.shutdown()


def _resize_in_meta(meta, part):
    """checkpoint.json edited to record part's size and SHA-256 (a forgery that fits)."""
    import hashlib
    import json
    data = json.load(open(meta))
    data["bytes"][0] = os.path.getsize(part)
    data["sha256"][0] = hashlib.sha256(open(part, "rb").read()).hexdigest()
    open(meta, "w").write(json.dumps(data))
