"""ShardedOptimizer (ZeRO stages 1 and 2) and ShardedModule (stage 3) on every rank under
mpirun: the same parameters as DistributedOptimizer after several steps, memory() per rank,
state dicts, bad input.
Data differs by rank; the model's parameter sizes divide by neither 2 nor 3."""
import copy
import io

import torch

import ringsync.torch as hvd
from ringsync.objects import broadcast_object

STEPS = 4
TINY = 1200 / 2 ** 20  # bucket_cap_mb of 1200 bytes: the model's 5 tensors in 4 buckets
# (stage, offload, bucket_cap_mb)
CONFIGS = [(1, False, 25), (1, True, 25), (2, False, 25), (2, True, 25), (1, False, TINY),
           (2, False, TINY), (2, True, TINY)]


class _Model(torch.nn.Module):
    """Parameters of 403, 31, 155, 5 and 11 elements (605 trainable) and a frozen one."""

    def __init__(self, dtype=torch.float64, extra_dtype=None):
        super().__init__()
        torch.manual_seed(11)
        self.l1 = torch.nn.Linear(13, 31).to(dtype)
        self.l2 = torch.nn.Linear(31, 5).to(dtype)
        self.extra = torch.nn.Parameter(torch.randn(11).to(extra_dtype or dtype))
        self.frozen = torch.nn.Parameter(torch.ones(4, dtype=dtype), requires_grad=False)

    def loss(self, step):
        me = hvd.rank()
        g = torch.Generator().manual_seed(1000 * me + step)
        x = torch.randn(6, 13, generator=g).to(self.l1.weight.dtype)
        out = self.l2(torch.tanh(self.l1(x)))
        loss = (out ** 2).mean() + (self.frozen.sum() * out).mean()
        if me == 0:  # the other ranks have no gradient for it: zeros, as DistributedOptimizer
            loss = loss + (self.extra.to(out.dtype) * torch.randn(11, generator=g)
                           .to(out.dtype)).sum() ** 2
        return loss


def _optimizer(model, kind):
    return _grouped_optimizer(kind, list(model.l1.parameters()),
                              [*model.l2.parameters(), model.extra, model.frozen])


def _grouped_optimizer(kind, first, second):
    groups = [{"params": first}, {"params": second, "lr": 0.03, "weight_decay": 0.01}]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)


def _train(model, opt, steps, first=0, loss=lambda model, step: model.loss(step)):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(first, first + steps):
        opt.zero_grad()
        loss(model, step).backward()
        opt.step()
        sched.step()
    return sched


def _close(a, b, rtol, what):
    scale = max(b.abs().max().item(), 1e-300) if b.numel() else 1.0
    err = (a.double() - b.double()).abs().max().item() / scale if b.numel() else 0.0
    assert err <= rtol, f"{what}: relative difference {err:.3g} > {rtol}"


def _same_parameters(model, ref, rtol, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach(), q.detach(), rtol, f"{what}: {name}")


def _state_bytes(opt):
    return sum(v.numel() * v.element_size() for st in opt.state.values()
               for v in st.values() if torch.is_tensor(v))


def _reference(kind, steps=STEPS, dtype=torch.float64, extra_dtype=None):
    model = _Model(dtype, extra_dtype)
    opt = hvd.DistributedOptimizer(_optimizer(model, kind),
                                   named_parameters=model.named_parameters())
    _train(model, opt, steps)
    return model, opt


def bfloat16_parameters():
    """bfloat16 parameters at stages 1 and 2: each rank steps a float32 master of its
    pieces and writes it back rounded; every rank ends with the same parameters, close to
    the float32 run (the master keeps what bfloat16 rounds away)."""
    hvd.init()
    ref, _ = _reference("adam", dtype=torch.float32)
    for stage in (1, 2):
        model = _Model(torch.bfloat16)
        opt = hvd.ShardedOptimizer(_optimizer(model, "adam"), stage=stage, bucket_cap_mb=TINY)
        _train(model, opt, STEPS)
        what = f"bfloat16 stage {stage}"
        for s in opt._shards:
            assert s.master.dtype == torch.float32 and not s.is_view, what
            a, b = s.ranges[0] if s.ranges else (0, 0)
            assert torch.equal(s.run.flat[a: b], s.master.detach().to(torch.bfloat16)), what
        assert any(not torch.equal(s.master.detach(), s.master.detach().bfloat16().float())
                   for s in opt._shards), f"{what}: the masters hold nothing beyond bfloat16"
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()
        everyone = hvd.allgather(flat.unsqueeze(0), name=f"bf16.params.{stage}")
        assert all(torch.equal(row, flat) for row in everyone), f"{what}: ranks differ"
        _same_parameters(model, ref, 5e-2, what)
    hvd.shutdown()


def same_as_distributed_optimizer():
    """Stages 1 and 2, offload on and off, Adam and SGD with Nesterov momentum: the same
    parameters as DistributedOptimizer to 1e-10, lr schedules included; memory() per rank;
    consolidate_state_dict equals the unsharded state."""
    hvd.init()
    size = hvd.size()
    trainable = 605 * 8
    for kind in ("adam", "sgd"):
        ref, ref_opt = _reference(kind)
        ref_state = ref_opt.state_dict()
        unsharded_state = _state_bytes(ref_opt)
        for stage, offload, cap in CONFIGS:
            what = f"{kind} stage {stage} offload {offload} bucket_cap_mb {cap:.4g}"
            model = _Model()
            opt = hvd.ShardedOptimizer(_optimizer(model, kind), model.named_parameters(),
                                       stage=stage, offload=offload, bucket_cap_mb=cap)
            buckets = 4 if cap == TINY else 1
            assert [len(run.buckets) for run in opt._runs.values()] == [buckets], what
            _train(model, opt, STEPS)
            _same_parameters(model, ref, 1e-10, what)
            assert [g["lr"] for g in opt.param_groups] == \
                [g["lr"] for g in ref_opt.param_groups], what
            mem = opt.memory()
            full_params = sum(p.numel() * 8 for p in model.parameters())
            slack = 8 * buckets  # (the first ranks own one element more of each bucket)
            if offload:  # (a master copy of this rank's pieces, apart)
                assert full_params + 605 // size * 8 - slack <= mem["parameters"] <= \
                    full_params + trainable / size + 2 * slack, (what, mem)
            else:  # (the pieces are stepped in place: no second copy of any)
                assert mem["parameters"] == full_params, (what, mem)
            assert mem["optimizer_state"] <= unsharded_state / size + 64 + 2 * slack, \
                (what, mem, unsharded_state)
            if stage == 1:
                assert mem["gradients"] <= trainable + trainable / size + 2 * slack, \
                    (what, mem)
            else:
                assert all(p.grad is None for p in model.parameters()), what
                assert mem["gradients"] <= trainable / size + 2 * slack, (what, mem)
            to = size - 1
            full = opt.consolidate_state_dict(to=to)
            if hvd.rank() != to:
                assert full is None
                continue
            assert full["param_groups"] == ref_state["param_groups"], what
            assert sorted(full["state"]) == sorted(ref_state["state"]), what
            plain = _optimizer(_Model(), kind)
            plain.load_state_dict(full)  # a torch optimizer takes it as it is
            for i, st in ref_state["state"].items():
                assert sorted(full["state"][i]) == sorted(st), (what, i)
                for key, value in st.items():
                    _close(full["state"][i][key], value, 1e-10, f"{what}: state {i} {key}")
        opt.zero_grad()
        assert opt.memory()["gradients"] == 0
    hvd.shutdown()


def state_dicts_and_mixed_dtypes():
    """Resuming from state_dict() and from a consolidated state dict continues exactly as
    an uninterrupted run; float32 and float64 parameters shard as two runs."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    for stage in (1, 2):
        ref, _ = _reference("adam", steps=2 * STEPS)
        model = _Model()
        opt = hvd.ShardedOptimizer(_optimizer(model, "adam"), stage=stage)
        schedule = _train(model, opt, STEPS).state_dict()
        saved, params = opt.state_dict(), copy.deepcopy(model.state_dict())
        full = broadcast_object(opt.consolidate_state_dict(to=0), 0, name=f"full{stage}")
        for source in (saved, full):
            resumed = _Model()
            resumed.load_state_dict(params)
            base = _optimizer(resumed, "adam")
            again = hvd.ShardedOptimizer(base, stage=stage)
            again.load_state_dict(source)
            sched = torch.optim.lr_scheduler.StepLR(again, step_size=2, gamma=0.5)
            sched.load_state_dict(schedule)
            for step in range(STEPS, 2 * STEPS):
                again.zero_grad()
                loss = again.step(lambda: _backward(resumed, step))
                assert torch.is_tensor(loss)
                sched.step()
            _same_parameters(resumed, ref, 1e-10, f"stage {stage} resumed from "
                             f"{'state_dict' if source is saved else 'consolidated'}")
        if size > 1:
            other = broadcast_object(saved, 1, name=f"rank1.state{stage}")
            if me != 1:
                _raises(lambda: opt.load_state_dict(other), "the state was saved by")
    # float32 and float64 parameters: two runs, each split over the ranks.
    ref, _ = _reference("adam", extra_dtype=torch.float32)
    model = _Model(extra_dtype=torch.float32)
    opt = hvd.ShardedOptimizer(_optimizer(model, "adam"), stage=2)
    _train(model, opt, STEPS)
    _same_parameters(model, ref, 1e-6, "mixed dtypes")
    assert len(opt._runs) == 2
    hvd.shutdown()


def _backward(model, step):
    loss = model.loss(step)
    loss.backward()
    return loss


def _raises(call, words):
    try:
        call()
    except hvd.UsageError as e:
        assert words in str(e), (words, str(e))
    else:
        raise AssertionError(f"no UsageError ({words})")


def bad_arguments():
    hvd.init()
    model = _Model()
    make = lambda **kw: hvd.ShardedOptimizer(_optimizer(model, "sgd"), **kw)  # noqa: E731
    _raises(lambda: make(stage=4), "stage must be 1, 2 or 3")
    _raises(lambda: make(stage=True), "stage must be 1, 2 or 3")
    _raises(lambda: make(stage="1"), "stage must be 1, 2 or 3")
    _raises(lambda: make(stage=3), "steps a ShardedModule's parameters")
    _raises(lambda: make(offload="yes"), "offload must be True or False")
    _raises(lambda: hvd.ShardedOptimizer(model), "wraps a torch.optim.Optimizer")
    _raises(lambda: make(named_parameters=list(model.named_parameters())[:2]),
            "does not name every parameter")
    ints = torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    _raises(lambda: hvd.ShardedOptimizer(torch.optim.SGD([model.extra, ints], lr=0.1),
                                         [("extra", model.extra), ("counts", ints)]),
            "'counts' is torch.int64")
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    _raises(lambda: hvd.ShardedOptimizer(torch.optim.SGD([model.extra, meta], lr=0.1)),
            "more than one device")
    _raises(lambda: hvd.ShardedOptimizer(torch.optim.SGD([model.frozen], lr=0.1)),
            "no parameter that requires grad")
    opt = make()
    _raises(lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]}),
            "add_param_group is not supported")
    _raises(lambda: opt.consolidate_state_dict(to=hvd.size()), "not a rank of the process set")
    _raises(lambda: opt.load_state_dict({"nonsense": 1}), "expected a ShardedOptimizer")
    with opt.skip_synchronize():
        _raises(opt.step, "needs a synchronize() first")
    # parameters a live ShardedOptimizer averages and steps: a second wrapper is refused
    # (the gradients would be averaged twice, the parameters stepped twice)
    _raises(make, "is already taken by a ShardedOptimizer, which steps it")
    _raises(lambda: hvd.DistributedOptimizer(_optimizer(model, "sgd"), model.named_parameters()),
            "'grad.l1.weight' is already taken by a ShardedOptimizer, which averages")
    saved = io.BytesIO()  # (the marks on the parameters pickle: a whole model saves)
    torch.save(model, saved)
    saved.seek(0)
    again = torch.load(saved, weights_only=False)
    hvd.DistributedOptimizer(_optimizer(again, "sgd"), again.named_parameters())
    hvd.shutdown()


def on_a_process_set():
    """Sharded over ranks [size-1, 0] only (the other ranks train nothing): the same
    parameters as DistributedOptimizer over that set."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    pair = hvd.add_process_set([size - 1, 0])
    if pair.included():
        ref = _Model()
        ref_opt = hvd.DistributedOptimizer(_optimizer(ref, "adam"), process_set=pair)
        _train(ref, ref_opt, STEPS)
        model = _Model()
        opt = hvd.ShardedOptimizer(_optimizer(model, "adam"), stage=2, process_set=pair)
        _train(model, opt, STEPS)
        _same_parameters(model, ref, 1e-10, "process set")
        assert opt.memory()["gradients"] <= 605 * 8 / 2 + 16
        full = opt.consolidate_state_dict(to=0)
        assert (full is not None) == (me == 0)
    assert hvd.remove_process_set(pair)
    hvd.shutdown()


class _Whole(_Model):
    """_Model with the whole loss as its forward (stage 3 gathers a module's parameters in
    its forward), every parameter reaching the loss on every rank (stage 3's gathers in
    backward are collectives), l2 used twice in one forward."""

    def forward(self, step):
        g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
        dtype = self.extra.dtype  # (l1.weight exists only while l1 runs)
        x = torch.randn(6, 13, generator=g).to(dtype)
        h = torch.tanh(self.l1(x))
        out = self.l2(h) + self.l2(h * h)
        w = torch.randn(11, generator=g).to(dtype)
        return (out ** 2).mean() + (self.frozen.sum() * out).mean() + (self.extra * w).sum() ** 2


def _stage3_optimizer(sharded, kind):
    """_optimizer's groups and hyperparameters, over the slices of the same modules."""
    by_path = {}
    for path, piece, _ in sharded.units():
        by_path.setdefault(path, []).append(piece)
    return _grouped_optimizer(kind, by_path["l1"], by_path["l2"] + by_path[""])


def _chain():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 9),
                               torch.nn.Tanh(), torch.nn.Linear(9, 3)).double()


def _prefetches_and_stays_exact():
    """From the second pass on, forward's gathers and backward's (the two last Linears'
    weights are saved for backward) are started ahead, while the unit before them runs;
    the parameters stay DistributedOptimizer's."""
    ref, chain = _chain(), hvd.ShardedModule(_chain())
    ref_opt = hvd.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1),
                                       ref.named_parameters())
    opt = hvd.ShardedOptimizer(torch.optim.SGD(chain.parameters(), lr=0.1), stage=3)
    taken, take = [], chain._prefetch.take
    chain._prefetch.take = lambda unit, phase: taken.append((phase, take(unit, phase))) \
        or taken[-1][1]
    for step in range(3):
        x = torch.randn(4, 5, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(10 * hvd.rank() + step))
        for model, o in ((ref, ref_opt), (chain, opt)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    ahead = {phase: sum(h is not None for p, h in taken if p == phase)
             for phase in ("gather", "regather")}
    assert ahead == {"gather": 2 * 2, "regather": 2 * 1}, (ahead, taken)
    _same_as_whole(chain, ref, 1e-10, "stage 3 with prefetch")


def _train_whole(model, opt, steps):
    return _train(model, opt, steps, loss=lambda model, step: model(step))


def _same_as_whole(sharded, ref, rtol, what):
    expected = dict(ref.named_parameters())
    with sharded.gathered_parameters() as full:
        names = [n for n, _ in full.named_parameters()]
        assert sorted(names) == sorted(expected), (what, names)
        for name, p in full.named_parameters():
            _close(p.detach(), expected[name].detach(), rtol, f"{what}: {name}")


def stage3_same_as_distributed_optimizer():
    """ShardedModule + ShardedOptimizer(stage=3), Adam and SGD with Nesterov momentum: the
    same parameters as DistributedOptimizer to 1e-10; between steps a rank holds 1/N of
    the parameters, gradients and optimizer state (+ one element per unit); a plain torch
    optimizer over the slices gives the same."""
    hvd.init()
    size = hvd.size()
    units, elements = 4, 609  # (extra; frozen; l1; l2), every parameter element
    for kind in ("adam", "sgd"):
        ref = _Whole()
        ref_opt = hvd.DistributedOptimizer(_optimizer(ref, kind), ref.named_parameters())
        _train_whole(ref, ref_opt, STEPS)
        unsharded_state = _state_bytes(ref_opt)
        for wrapped in (True, False):
            what = f"stage 3 {kind} {'ShardedOptimizer' if wrapped else 'plain optimizer'}"
            sharded = hvd.ShardedModule(_Whole())
            opt = _stage3_optimizer(sharded, kind)
            if wrapped:
                opt = hvd.ShardedOptimizer(opt, sharded.named_parameters(), stage=3)
            _train_whole(sharded, opt, STEPS)
            loss = sharded(STEPS)  # between forward and backward: no run kept for backward
            assert sharded.memory()["parameters"] <= (elements / size + units) * 8, \
                (what, sharded.memory())
            loss.backward()
            mem = sharded.memory()
            assert mem["parameters"] <= (elements / size + units) * 8, (what, mem)
            assert 0 < mem["gradients"] <= (605 / size + 3) * 8, (what, mem)
            opt.zero_grad()
            assert all(getattr(sharded.module.l1, n) is None for n in ("weight", "bias"))
            if wrapped:
                assert opt.memory()["optimizer_state"] <= unsharded_state / size + 64, \
                    (what, opt.memory(), unsharded_state)
                assert opt.memory()["parameters"] == mem["parameters"]
            _same_as_whole(sharded, ref, 1e-10, what)
    hvd.shutdown()


def stage3_details():
    """gathered_parameters() writes changes back; state_dict()/load_state_dict() resume
    exactly; mixed precision computes in bfloat16 and keeps float32 slices; bad input."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    ref = _Whole()
    ref_opt = hvd.DistributedOptimizer(_optimizer(ref, "adam"), ref.named_parameters())
    _train_whole(ref, ref_opt, 2 * STEPS)
    sharded = hvd.ShardedModule(_Whole())
    opt = hvd.ShardedOptimizer(_stage3_optimizer(sharded, "adam"), stage=3)
    schedule = _train_whole(sharded, opt, STEPS).state_dict()
    saved_model, saved_opt = copy.deepcopy(sharded.state_dict()), opt.state_dict()
    resumed = hvd.ShardedModule(_Whole())
    resumed.load_state_dict(saved_model)
    again = hvd.ShardedOptimizer(_stage3_optimizer(resumed, "adam"), stage=3)
    again.load_state_dict(saved_opt)
    sched = torch.optim.lr_scheduler.StepLR(again, step_size=2, gamma=0.5)
    sched.load_state_dict(schedule)
    for step in range(STEPS, 2 * STEPS):
        again.zero_grad()
        resumed(step).backward()
        again.step()
        sched.step()
    _same_as_whole(resumed, ref, 1e-10, "stage 3 resumed from state_dict()")
    _prefetches_and_stays_exact()
    if size > 1:
        other = broadcast_object(saved_opt, 1, name="stage3.rank1")
        if me != 1:
            _raises(lambda: again.load_state_dict(other), "the state was saved by")
    # gathered_parameters: changes inside are kept, on every rank's slice.
    with sharded.gathered_parameters() as full:
        before = full.l1.weight.detach().clone()
        with torch.no_grad():
            full.l1.weight.add_(1.0)
    with sharded.gathered_parameters() as full:
        _close(full.l1.weight.detach(), before + 1.0, 1e-15, "writeback")
    assert sharded.module.l1.weight is None
    # mixed precision: bfloat16 compute, float32 slices; close to the float32 run.
    ref32 = _Whole(torch.float32)
    opt32 = hvd.DistributedOptimizer(_optimizer(ref32, "sgd"), ref32.named_parameters())
    _train_whole(ref32, opt32, STEPS)
    low = hvd.ShardedModule(_Whole(torch.float32), mixed_precision=torch.bfloat16)
    assert low(0).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in low.parameters())
    low_opt = hvd.ShardedOptimizer(_stage3_optimizer(low, "sgd"), stage=3)
    _train_whole(low, low_opt, STEPS)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in low.parameters())
    _same_as_whole(low, ref32, 3e-2, "bfloat16 compute")
    # bad input
    _raises(lambda: hvd.ShardedModule(torch.nn.Tanh()), "no parameters to shard")
    _raises(lambda: hvd.ShardedModule(_Whole(), mixed_precision=torch.float64),
            "mixed_precision must be")
    tied = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    _raises(lambda: hvd.ShardedModule(tied), "shared by two modules")
    _raises(lambda: hvd.ShardedOptimizer(_stage3_optimizer(_keep(sharded), "sgd"), stage=1),
            "already a ShardedModule slice")
    _raises(lambda: hvd.ShardedOptimizer(_stage3_optimizer(sharded, "sgd"), stage=3,
                                         offload=True), "offload=True is not supported")
    with sharded.gathered_parameters():
        _raises(lambda: sharded.gathered_parameters().__enter__(), "already inside one")
    # a ShardedModule's backward averages its slices' gradients: DistributedOptimizer
    # would average them again; one ShardedOptimizer steps them, a second would again
    _raises(lambda: hvd.DistributedOptimizer(_stage3_optimizer(sharded, "sgd")),
            "is already taken by a ShardedModule, which averages its gradient")
    _raises(lambda: hvd.ShardedOptimizer(_stage3_optimizer(sharded, "sgd"), stage=3),
            "is already taken by a ShardedOptimizer, which steps it")  # (opt, above)
    import gc
    del opt
    gc.collect()
    hvd.ShardedOptimizer(_stage3_optimizer(sharded, "sgd"), stage=3)  # (opt is gone)
    hvd.shutdown()


def _keep(x):
    return x


def reductions_start_during_backward():
    """Stage 2 with one bucket per tensor: backward itself hands every gradient to a
    reduction (each p.grad is gone before step()); over two backward passes per step
    (backward_passes_per_step=2) the same parameters as DistributedOptimizer's; a third
    pass is refused."""
    hvd.init()
    ref = _Model()
    # (named: unnamed optimizers are numbered per process, and on_a_process_set made one
    # on some ranks only)
    ref_opt = hvd.DistributedOptimizer(_optimizer(ref, "adam"), ref.named_parameters(),
                                       backward_passes_per_step=2)
    model = _Model()
    opt = hvd.ShardedOptimizer(_optimizer(model, "adam"), stage=2, bucket_cap_mb=TINY,
                               backward_passes_per_step=2)
    for m, o in ((ref, ref_opt), (model, opt)):
        for step in range(STEPS):
            o.zero_grad()
            m.loss(2 * step).backward()
            m.loss(2 * step + 1).backward()
            if o is opt:
                # Buckets: l1.weight, l1.bias, l2.weight, (l2.bias, extra); extra has a
                # gradient on rank 0 only, so its bucket waits for step() elsewhere.
                assert all(p.grad is None for p in (m.l1.weight, m.l1.bias, m.l2.weight)), \
                    "stage 2: gradients were not taken during backward"
                started = 4 if hvd.rank() == 0 else 3
                assert len(opt._reductions.inflight) == started, opt._reductions.inflight.keys()
            o.step()
    _same_parameters(model, ref, 1e-10, "backward_passes_per_step=2")
    # A second ShardedOptimizer over the same parameters: the dropped first one's hooks
    # must not start reductions (they would hang or raise at the next backward).
    import gc
    again = _Model()
    first = hvd.ShardedOptimizer(_optimizer(again, "sgd"), stage=2)
    del first
    gc.collect()
    second = hvd.ShardedOptimizer(_optimizer(again, "sgd"), stage=2)
    reference = _Model()
    _train(reference, hvd.DistributedOptimizer(_optimizer(reference, "sgd"),
                                               reference.named_parameters()), 3)
    _train(again, second, 3)
    _same_parameters(again, reference, 1e-10, "a second optimizer over the same model")
    opt.zero_grad()
    for step in range(2):
        model.loss(step).backward()
    _raises(lambda: model.loss(9).backward(), "more than backward_passes_per_step=2")
    opt.zero_grad()
    hvd.shutdown()
