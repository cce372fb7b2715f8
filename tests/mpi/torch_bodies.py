"""PyTorch adapter bodies, run on every rank under mpirun. References come from every
rank's input (computed locally on each rank) or from one process training on the whole
batch."""
import copy
import os

import numpy as np
import torch

import ringsync.torch as hvd

from tests.common.reference import assert_reduced, rank_input

TORCH_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "uint16": torch.uint16,
                "int16": torch.int16, "int32": torch.int32,
                "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float32": torch.float32, "float64": torch.float64}


def _tensor(rank, shape, dtype, op="Sum", salt=""):
    arr = rank_input(rank, shape, dtype, op, salt)
    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


def _as_numpy(t):
    from ml_dtypes import bfloat16
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


def collectives_on_tensors():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    for dtype in TORCH_DTYPES:
        for op in ["Sum", "Average", "Min", "Max", "Product"]:
            for shape in [(0,), (1,), (7, 3), (1001,)]:
                inputs = [rank_input(r, shape, dtype, op, "t") for r in range(size)]
                mine = _tensor(me, shape, dtype, op, "t")
                what = f"torch allreduce {dtype} {op} {shape}"
                got = hvd.allreduce(mine, op=getattr(hvd, op), name=what)
                assert got.dtype == mine.dtype and got.shape == mine.shape, what
                assert_reduced(_as_numpy(got), inputs, op, what=what)
                h = hvd.allreduce_async_(mine, op=getattr(hvd, op), prescale_factor=0.5,
                                         postscale_factor=2.0, name="inplace " + what)
                assert hvd.synchronize(h) is mine
                assert_reduced(_as_numpy(mine), inputs, op, 0.5, 2.0, what="in place " + what)
    # A non-contiguous tensor reduced in place: staged, then copied back into the view.
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (me + 1)
    view = base[:, ::2]
    hvd.allreduce_(view, op=hvd.Sum)
    expected = torch.arange(24, dtype=torch.float64).reshape(4, 6)[:, ::2] * sum(range(1, size + 1))
    assert torch.equal(view, expected) and torch.equal(base[:, ::2], expected)
    # allgather (differing first dimension), broadcast, reducescatter, alltoall, grouped.
    parts = [torch.full((r + 1, 2), float(r)) for r in range(size)]
    assert torch.equal(hvd.allgather(parts[me]), torch.cat(parts))
    assert torch.equal(hvd.broadcast(torch.arange(5) + me, root_rank=size - 1),
                       torch.arange(5) + size - 1)
    t = torch.arange(3, dtype=torch.int32) + me
    hvd.broadcast_(t, root_rank=0)
    assert torch.equal(t, torch.arange(3, dtype=torch.int32))
    full = torch.arange(size * 2 * 3, dtype=torch.float32).reshape(size * 2, 3)
    assert torch.equal(hvd.reducescatter(full * (me + 1), op=hvd.Sum),
                       full[2 * me: 2 * me + 2] * sum(range(1, size + 1)))
    out, received = hvd.alltoall(torch.arange(size) + 10 * me, splits=[1] * size)
    assert torch.equal(out, torch.arange(size) * 10 + me) and received.tolist() == [1] * size
    group = hvd.grouped_allreduce([torch.ones(2) * me, torch.ones(3, dtype=torch.int64)],
                                  op=hvd.Sum)
    assert torch.equal(group[0], torch.full((2,), float(sum(range(size)))))
    assert torch.equal(group[1], torch.full((3,), size, dtype=torch.int64))
    hvd.shutdown()


def gradients_through_collectives():
    """Autograd through allreduce, allgather and broadcast against analytic gradients."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    weights = torch.arange(1.0, 5.0, dtype=torch.float64)  # d loss / d output, per element
    # allreduce Sum: y = sum_r x_r on every rank; loss = sum over ranks of (w * (r+1)) . y
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, name="g.sum")
    (y * weights * (me + 1)).sum().backward()
    assert torch.allclose(x.grad, weights * sum(range(1, size + 1)), rtol=1e-12)
    # allreduce Average with scale factors: y = pre * post * mean_r x_r
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0, postscale_factor=3.0, name="g.avg")
    (y * weights).sum().backward()
    assert torch.allclose(x.grad, weights * 6.0, rtol=1e-12)  # (6/N) summed over N ranks
    # allgather: rank r contributes r+1 rows; loss weights each output row by its index
    x = torch.ones(me + 1, 2, dtype=torch.float64, requires_grad=True)
    y = hvd.allgather(x, name="g.gather")
    rows = torch.arange(y.shape[0], dtype=torch.float64).unsqueeze(1)
    (y * rows * (me + 1)).sum().backward()
    # Horovod's rule: the ranks' upstream gradients averaged, this rank's rows of it.
    start = sum(r + 1 for r in range(me))
    expected = torch.arange(start, start + me + 1, dtype=torch.float64).unsqueeze(1) * \
        sum(range(1, size + 1)) / size
    assert torch.allclose(x.grad, expected.expand(me + 1, 2)), (x.grad, expected)
    # broadcast from the last rank: only the root's input gets a gradient, the mean of all
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = hvd.broadcast(x, root_rank=size - 1, name="g.bcast")
    (y * (me + 1)).sum().backward()
    root_grad = torch.full((3,), sum(range(1, size + 1)) / size, dtype=torch.float64)
    assert torch.equal(x.grad, root_grad if me == size - 1 else torch.zeros(3, dtype=torch.float64))
    hvd.shutdown()


# ---- equivalence: N ranks on 1/N of each batch == one process on the whole batch ----

def _model(dtype):
    torch.manual_seed(1234)  # identical start everywhere
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(dtype)


def _batches(dtype, steps, per_rank, size):
    g = torch.Generator().manual_seed(99)
    for _ in range(steps):
        x = torch.randn(per_rank * size, 10, generator=g).to(dtype)
        y = torch.randn(per_rank * size, 3, generator=g).to(dtype)
        yield x, y


def _make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01)


def _train(model, optimizer, batches, passes, shard):
    """Each step runs `passes` backward passes (micro-batches) before one optimizer step."""
    for x, y in batches:
        optimizer.zero_grad()
        micro_x, micro_y = x.chunk(passes), y.chunk(passes)
        for mx, my in zip(micro_x, micro_y):
            mx, my = shard(mx), shard(my)
            loss = torch.nn.functional.mse_loss(model(mx), my)
            loss.backward()
        optimizer.step()


def training_matches_one_process(kind="sgd", dtype_name="float64", passes="1", compression="none",
                                 grads="plain"):
    """grads: "views" trains with gradient_as_bucket_view=True."""
    hvd.init()
    mode = os.environ.get("RINGSYNC_OVERLAP", "auto")  # (the test picks the path it checks)
    assert mode == "auto" or hvd.global_process_set.communicator().overlaps == (mode == "on")
    dtype = getattr(torch, dtype_name)
    passes, size, me = int(passes), hvd.size(), hvd.rank()
    per_rank = 4 * passes
    steps = 6
    reference = _model(dtype)
    ref_opt = _make_optimizer(kind, reference.parameters())
    _train(reference, ref_opt, _batches(dtype, steps, per_rank, size), passes, lambda t: t)

    model = _model(dtype)
    opt = hvd.DistributedOptimizer(_make_optimizer(kind, model.parameters()),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, compression),
                                   backward_passes_per_step=passes,
                                   gradient_as_bucket_view=grads == "views")

    def shard(t):  # this rank's contiguous share of a micro-batch
        n = t.shape[0] // size
        return t[me * n:(me + 1) * n]

    _train(model, opt, _batches(dtype, steps, per_rank, size), passes, shard)
    # Compressed gradients lose precision on the wire (fp16: 11 bits, bf16: 8 bits).
    rtol = {"none": {"float64": 1e-10, "float32": 1e-5}[dtype_name], "fp16": 1e-2,
            "bf16": 3e-2}[compression]
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        err = ((p - q).abs().max() / q.abs().max()).item()  # relative to the tensor's scale
        assert err < rtol, (f"{kind} {dtype_name} passes={passes} {compression} {grads}: {name} "
                            f"off by {err:.2e}")
    # Every rank ends with the same parameters, bit for bit.
    for name, p in model.named_parameters():
        assert torch.equal(hvd.broadcast(p.detach(), 0, name=f"check.{name}"), p.detach()), name
    hvd.shutdown()


def bucket_views_alias_across_steps():
    """gradient_as_bucket_view=True, gradients reduced at step() (overlap off) or in
    buckets from the hooks (on): after a step every gradient is a view of one buffer and
    holds the average of every rank's gradient (computed here from a replica's own
    backward); a gradient kept from the step before is that same memory (the documented
    hazard: it shows the newest average, not its own step's); a gradient the caller
    replaced with a tensor of its own is copied in and becomes a view again; zero_grad()
    zeroes in place. With overlap, from the second step on every hook finds its gradient
    a view of its bucket (so a bucket is reduced as one request)."""
    import copy

    from ringsync.torch.optimizer import overlaps
    hvd.init()
    overlap = overlaps(hvd.global_process_set.communicator())
    me = hvd.rank()
    model = _model(torch.float64)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   gradient_as_bucket_view=True)
    params = list(model.parameters())
    kept = None
    for step in range(4):
        opt.zero_grad()
        if kept is not None:
            assert all(torch.count_nonzero(k) == 0 for k in kept), "zero_grad in place"
            if overlap:
                assert all(opt._buckets.is_view(p) for p in params), "bucket views"
        g = torch.Generator().manual_seed(7 * step + me)
        x, y = torch.randn(5, 10, generator=g, dtype=torch.float64), \
            torch.randn(5, 3, generator=g, dtype=torch.float64)
        replica = copy.deepcopy(model)
        torch.nn.functional.mse_loss(replica(x), y).backward()
        expected = [hvd.allreduce(q.grad, op=hvd.Average, name=f"expect.{step}.{i}")
                    for i, q in enumerate(replica.parameters())]
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 2 and not overlap:  # the caller puts a tensor of its own in place of one
            params[0].grad = params[0].grad.clone() * 1.0
        opt.step()
        for i, (p, e) in enumerate(zip(params, expected)):
            assert torch.allclose(p.grad, e, rtol=1e-12, atol=0), f"step {step} grad {i}"
        ptrs = sorted((p.grad.data_ptr(), p.grad.numel() * 8) for p in params)
        assert all(a + n == b for (a, n), (b, _) in zip(ptrs, ptrs[1:])), \
            "the gradients are consecutive views of one buffer"
        if kept is not None:
            for k, p in zip(kept, params):
                assert k.data_ptr() == p.grad.data_ptr() and torch.equal(k, p.grad), \
                    "a kept gradient is the buffer's memory: it shows the newest average"
        kept = [p.grad for p in params]
    hvd.shutdown()


def broadcast_makes_ranks_identical():
    hvd.init()
    me = hvd.rank()
    torch.manual_seed(me)  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if me == 0:  # only the root has optimizer state (Adam's moments) before the broadcast
        model(torch.randn(8, 5)).sum().backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    root_params = hvd.broadcast_object({k: v.clone() for k, v in model.state_dict().items()}, 0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, root_params[k]), k
    root_state = hvd.broadcast_object(opt.state_dict(), 0)
    mine = opt.state_dict()
    assert mine["param_groups"] == root_state["param_groups"]
    for idx, st in root_state["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(mine["state"][idx][key]), torch.as_tensor(value)), key
    assert hvd.allgather_object(("rank", me)) == [("rank", r) for r in range(hvd.size())]
    hvd.shutdown()


def sync_batch_norm_matches_full_batch():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    full = torch.randn(6 * size, 3, 5, dtype=torch.float64)
    weight_grad = torch.randn(6 * size, 3, 5, dtype=torch.float64)
    bn = torch.nn.BatchNorm1d(3).double()
    sync = hvd.SyncBatchNorm(3).double()
    with torch.no_grad():
        for m in (bn, sync):
            m.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x_full = full.clone().requires_grad_()
    (bn(x_full) * weight_grad).sum().backward()
    shard = slice(me * 6, (me + 1) * 6)
    x = full[shard].clone().requires_grad_()
    out = sync(x)
    (out * weight_grad[shard]).sum().backward()
    expected = torch.nn.functional.batch_norm(full, None, None, bn.weight.detach(),
                                              bn.bias.detach(), True, 0.0, 1e-5)[shard]
    assert torch.allclose(out, expected, rtol=1e-9, atol=1e-12)
    assert torch.allclose(x.grad, x_full.grad[shard], rtol=1e-9, atol=1e-12)
    for name in ("weight", "bias"):
        summed = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum, name=f"bn.{name}")
        assert torch.allclose(summed, getattr(bn, name).grad, rtol=1e-9), name
    assert torch.allclose(sync.running_mean, bn.running_mean, rtol=1e-9)
    assert torch.allclose(sync.running_var, bn.running_var, rtol=1e-9)
    sync.eval()
    bn.eval()
    assert torch.allclose(sync(full[shard]), bn(full[shard]), rtol=1e-9)
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2)))
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    hvd.shutdown()


def optimizer_misuse_and_state():
    hvd.init()
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(3, 4)).sum().backward()
    try:
        opt.zero_grad()
    except hvd.UsageError as e:
        assert "pending" in str(e)
    else:
        raise AssertionError("zero_grad with pending reductions was accepted")
    try:
        model(torch.ones(3, 4)).sum().backward()  # a second pass with backward_passes_per_step=1
    except hvd.UsageError as e:
        assert "more than backward_passes_per_step=1 times" in str(e), str(e)
    else:
        raise AssertionError("a second backward before step() was accepted")
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.05
    state = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(state)
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.05
    # A parameter without a gradient on one rank only: reduced as zeros, no hang.
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(list(a.parameters()) + list(b.parameters()),
                                                    lr=1.0))
    before = b.weight.detach().clone()
    out = a(torch.ones(1, 2))
    if hvd.rank() == 0:
        out = out + b(torch.ones(1, 2))
    out.sum().backward()
    opt2.step()
    summed = hvd.broadcast(b.weight.detach(), 0, name="b.check")
    assert torch.equal(summed, b.weight.detach())  # identical on every rank
    if hvd.size() > 1:
        assert not torch.equal(before, b.weight.detach())  # rank 0's gradient, averaged
    hvd.shutdown()


def join_lets_ranks_with_less_data_stop_early():
    """Rank r has 1 + r batches. Ranks that run out call hvd.join(); the others' steps
    still complete (the joined ranks' gradients count as zeros) and stay in agreement."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    for step in range(1 + me):
        before = model.weight.detach().clone()
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()  # gradient: ones on every rank
        opt.step()
        active = sum(1 for r in range(size) if step < 1 + r)
        assert torch.allclose(before - model.weight.detach(), torch.full((1, 3), active / size))
    assert hvd.join() == size - 1
    final = hvd.broadcast(model.weight.detach(), size - 1, name="join.final")
    if me == size - 1:
        assert torch.equal(final, model.weight.detach())
    hvd.shutdown()


def cuda_tensors_are_staged_through_host():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    x = torch.full((1000,), float(me + 1), device=device)
    got = hvd.allreduce(x, op=hvd.Sum)
    assert got.device == device and torch.all(got == sum(range(1, size + 1)))
    hvd.allreduce_(x, op=hvd.Average)
    assert x.device == device and torch.allclose(x, torch.full_like(x, (size + 1) / 2))
    y = hvd.broadcast(torch.arange(4.0, device=device) + me, root_rank=0)
    assert y.device == device and torch.equal(y.cpu(), torch.arange(4.0))
    g = hvd.allgather(torch.ones(2, 2, device=device) * me)
    assert g.device == device and g.shape == (2 * size, 2)
    w = torch.ones(3, device=device, requires_grad=True)
    hvd.allreduce(w, op=hvd.Sum).sum().backward()
    assert w.grad.device == device and torch.all(w.grad == size)
    hvd.shutdown()
