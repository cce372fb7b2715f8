"""horovod.torch's API as a Horovod user calls it (positional and keyword forms), on every
rank under mpirun: process sets, the average=/op= rules, compression on collectives, the
grouped and sparse collectives, differentiable reducescatter/alltoall/grouped ops,
DistributedOptimizer's groups and sparse gradients, error classes, build probes.
References are built from every rank's input."""
import time
import warnings

import torch

import ringsync.torch as hvd


def _rank_tensor(rank, n, salt=0.0, dtype=torch.float64):
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + salt * (rank - 0.5)).to(dtype)


def argument_rules_and_compression():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    x = _rank_tensor(me, 5)
    total = sum(_rank_tensor(r, 5) for r in range(size))
    # op=None means Average; positional Horovod order: (tensor, average, name, compression, op)
    assert torch.allclose(hvd.allreduce(x), total / size)
    assert torch.allclose(hvd.allreduce(x, None, "pos.sum", hvd.Compression.none, hvd.Sum),
                          total)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.allclose(hvd.allreduce(x, average=False, name="avg.false"), total)
        assert torch.allclose(hvd.allreduce(x, average=True, name="avg.true"), total / size)
    assert sum(issubclass(w.category, DeprecationWarning) and "`average`" in str(w.message)
               for w in caught) == 2, [str(w.message) for w in caught]
    try:
        hvd.allreduce(x, average=True, op=hvd.Sum)
    except ValueError as e:
        assert "supersedes average" in str(e), e
    else:
        raise AssertionError("average= and op= together were accepted")
    # allreduce_async(tensor, average, name, op, prescale, postscale, process_set)
    h = hvd.allreduce_async(x, None, "pos.async", hvd.Sum, 2.0, 0.5)
    assert torch.allclose(hvd.synchronize(h), total)
    y = x.clone()
    hvd.synchronize(hvd.allreduce_async_(y, None, "pos.async_", hvd.Sum))
    assert torch.allclose(y, total)
    # fp16 compression on the wire: float64 in, float64 out, float16's precision.
    got = hvd.allreduce(x, name="fp16", compression=hvd.Compression.fp16, op=hvd.Sum)
    assert got.dtype == torch.float64 and torch.allclose(got, total, rtol=1e-3)
    # reducescatter(tensor, name, compression, op, process_set, prescale, postscale)
    full = torch.stack([_rank_tensor(me, 3, salt=i) for i in range(2 * size)])
    want = sum(torch.stack([_rank_tensor(r, 3, salt=i) for i in range(2 * size)])
               for r in range(size))
    got = hvd.reducescatter(full, "rs.pos", hvd.Compression.none, hvd.Sum,
                            hvd.global_process_set, 2.0, 1.0)
    assert torch.allclose(got, 2.0 * want[2 * me: 2 * me + 2])
    assert torch.allclose(hvd.reducescatter(full, name="rs.avg"), (want / size)[2 * me: 2 * me + 2])
    # grouped_allgather / grouped_reducescatter: lists in, lists out
    a, b = torch.full((me + 1, 2), float(me)), torch.full((1,), me, dtype=torch.int32)
    ga, gb = hvd.grouped_allgather([a, b], name="gag")
    assert torch.equal(ga, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(size)]))
    assert gb.tolist() == list(range(size))
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([full, 2 * full], name="grs",
                                                           op=hvd.Sum))
    assert torch.allclose(outs[0], want[2 * me: 2 * me + 2])
    assert torch.allclose(outs[1], 2 * want[2 * me: 2 * me + 2])
    hvd.barrier()
    hvd.barrier(process_set=hvd.global_process_set)
    hvd.shutdown()


def sparse_allreduce_and_probes():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    indices = torch.tensor([[me, (me + 1) % 4]])
    values = torch.tensor([[1.0 + me, 2.0], [3.0, 4.0 * (me + 1)]])
    sparse = torch.sparse_coo_tensor(indices, values, (4, 2))
    wait = hvd.sparse_allreduce_async(sparse, "sparse.sum", hvd.Sum)
    got = wait().to_dense()
    want = sum(torch.sparse_coo_tensor(torch.tensor([[r, (r + 1) % 4]]),
                                       torch.tensor([[1.0 + r, 2.0], [3.0, 4.0 * (r + 1)]]),
                                       (4, 2)).to_dense() for r in range(size))
    assert torch.allclose(got, want), (got, want)
    got = hvd.sparse_allreduce_async(sparse, "sparse.avg", hvd.Average)().to_dense()
    assert torch.allclose(got, want / size)
    # Build probes answer for ringsync: MPI bootstraps; no Gloo/NCCL/CUDA code.
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built()
    assert hvd.nccl_built() == 0 and not hvd.cuda_built() and not hvd.rocm_built()
    assert not (hvd.ddl_built() or hvd.ccl_built() or hvd.gloo_enabled())
    assert isinstance(hvd.mpi_threads_supported(), bool) and hvd.is_homogeneous()
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    # A mismatch between ranks is a RuntimeError (and a ValueError); the next call works.
    try:
        hvd.allreduce(torch.ones(2 + me), name="mismatch")
    except RuntimeError as e:
        assert isinstance(e, ValueError) and "mismatch" in str(e), e
    else:
        assert size == 1, "a shape mismatch was accepted"
    # A name still in flight is a ValueError at the call (rank 0 submits late, so the
    # others' first call is certainly still in flight when they repeat it).
    if me == 0:
        time.sleep(0.3)
    h = hvd.allreduce_async(torch.ones(3), name="in.flight")
    if me != 0:
        try:
            hvd.allreduce_async(torch.ones(3), name="in.flight")
        except ValueError as e:
            assert "in.flight" in str(e), e
        else:
            raise AssertionError("a duplicate in-flight name was accepted")
    hvd.synchronize(h)
    assert hvd.allreduce(torch.ones(1), name="after", op=hvd.Sum).item() == size
    from torch.nn.modules.batchnorm import _BatchNorm
    assert isinstance(hvd.SyncBatchNorm(3), _BatchNorm)
    hvd.shutdown()


def more_gradients():
    """reducescatter, alltoall and the grouped ops, differentiable as in Horovod."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    # grouped_allreduce Sum: the gradient is the sum of the ranks' upstream gradients.
    xs = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum, name="gg")
    ((ys[0] * (me + 1)).sum() + (ys[1] * 2).sum()).backward()
    assert torch.allclose(xs[0].grad, torch.full((3,), float(sum(range(1, size + 1))),
                                                 dtype=torch.float64))
    assert torch.allclose(xs[1].grad, torch.full((3,), 2.0 * size, dtype=torch.float64))
    # alltoall: each received row's gradient returns to its sender.
    x = torch.arange(size, dtype=torch.float64).mul(me + 1).requires_grad_()
    out, received = hvd.alltoall(x, splits=[1] * size, name="a2a.g")
    (out * torch.arange(1.0, size + 1, dtype=torch.float64)).sum().backward()
    # row i of x went to rank i, where it landed at position me, weighted by me + 1.
    assert torch.allclose(x.grad, torch.full((size,), float(me + 1), dtype=torch.float64))
    # reducescatter: Horovod's rule, upstream gradient (x size for Sum) allgathered.
    x = torch.ones(2 * size, 2, dtype=torch.float64, requires_grad=True)
    y = hvd.reducescatter(x, name="rs.g", op=hvd.Sum)
    (y * (me + 1)).sum().backward()
    want = torch.cat([torch.full((2, 2), float((r + 1) * size), dtype=torch.float64)
                      for r in range(size)])
    assert torch.allclose(x.grad, want.double()), (x.grad, want)
    x = torch.ones(2 * size, 2, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, name="rs.avg.g") * (me + 1)).sum().backward()
    assert torch.allclose(x.grad, (want / size).double())
    # grouped_allgather: averaged upstream gradients, this rank's rows.
    a = torch.ones(me + 1, dtype=torch.float64, requires_grad=True)
    (ga,) = hvd.grouped_allgather([a], name="gag.g")
    (ga * (me + 1)).sum().backward()
    assert torch.allclose(a.grad, torch.full((me + 1,), sum(range(1, size + 1)) / size,
                                             dtype=torch.float64))
    hvd.shutdown()


def _params():
    torch.manual_seed(7)
    return torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)


def optimizer_groups_and_sparse():
    """groups=, num_groups=, set_backward_passes_per_step, several param groups without
    named_parameters, sparse embeddings both ways: every variant ends where plain SGD on
    the averaged gradient does."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    for variant in ["plain", "groups=2", "groups=list", "num_groups=1", "param_groups"]:
        first, second = _params()
        ref_first, ref_second = _params()
        params = list(first.parameters()) + list(second.parameters())
        if variant == "param_groups":
            base = torch.optim.SGD([{"params": first.parameters()},
                                    {"params": second.parameters(), "lr": 0.05}], lr=0.1)
            ref = torch.optim.SGD([{"params": ref_first.parameters()},
                                   {"params": ref_second.parameters(), "lr": 0.05}], lr=0.1)
        else:
            base = torch.optim.SGD(params, lr=0.1)
            ref = torch.optim.SGD(list(ref_first.parameters()) + list(ref_second.parameters()),
                                  lr=0.1)
        kwargs = {"groups=2": {"groups": 2}, "groups=list": {"groups": [params[:2]]},
                  "num_groups=1": {"num_groups": 1}}.get(variant, {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            opt = hvd.DistributedOptimizer(base, **kwargs)
        opt.set_backward_passes_per_step(2)
        for step in range(2):
            opt.zero_grad()
            for part in range(2):  # two backward passes accumulate, then one reduction
                x = torch.full((1, 3), float(me + part + step))
                second(first(x)).sum().backward()
            opt.step()
            ref.zero_grad()
            for r in range(size):
                for part in range(2):
                    x = torch.full((1, 3), float(r + part + step))
                    (ref_second(ref_first(x)).sum() / size).backward()
            ref.step()
        for p, q in zip(params, list(ref_first.parameters()) + list(ref_second.parameters())):
            assert torch.allclose(p, q, atol=1e-6), (variant, p, q)
    for as_dense in (False, True):
        torch.manual_seed(3)
        emb = torch.nn.Embedding(6, 2, sparse=True)
        ref = torch.nn.Embedding(6, 2, sparse=True)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(),
                                       sparse_as_dense=as_dense)
        emb(torch.tensor([me, me + 1])).sum().backward()
        opt.step()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for r in range(size):
            (ref(torch.tensor([r, r + 1])).sum() / size).backward()
        ref_opt.step()
        assert torch.allclose(emb.weight, ref.weight), (as_dense, emb.weight, ref.weight)
    hvd.shutdown()


def process_sets_concurrently():
    """4 ranks: a static set, two disjoint sets added at run time running at once, an
    optimizer reducing within a set, a call from outside a set refused, removal."""
    static = hvd.ProcessSet([0, 3])
    hvd.init(process_sets=[static])
    me, size = hvd.rank(), hvd.size()
    assert size == 4, size
    assert static.process_set_id == 1 and static.size() == 2 and static.ranks == [0, 3]
    low = hvd.add_process_set([0, 1])
    high = hvd.add_process_set(hvd.ProcessSet([3, 2]))
    assert (low.process_set_id, high.process_set_id) == (2, 3) and high.ranks == [2, 3]
    mine, other = (low, high) if me < 2 else (high, low)
    assert mine.included() and not other.included() and mine.rank() == me % 2
    try:
        hvd.allreduce(torch.ones(1), process_set=other, name="outside")
    except ValueError as e:
        assert f"rank {me} is not a member" in str(e), e
    else:
        raise AssertionError("a rank outside the set was let in")
    for i in range(30):  # both sets at once, on rings of their own
        x = _rank_tensor(me, 6, salt=i)
        got = hvd.allreduce(x, name=f"set.{i}", op=hvd.Sum, process_set=mine)
        assert torch.allclose(got, sum(_rank_tensor(r, 6, salt=i) for r in mine.ranks))
        got = hvd.broadcast(x, root_rank=mine.ranks[1], process_set=mine, name=f"setb.{i}")
        assert torch.allclose(got, _rank_tensor(mine.ranks[1], 6, salt=i))
    got = hvd.allgather(torch.tensor([me]), process_set=mine)
    assert got.tolist() == mine.ranks
    if static.included():
        got = hvd.allreduce(torch.tensor([float(me)]), process_set=static)  # Average over 2
        assert got.item() == 1.5
        obj = hvd.broadcast_object({"from": me}, root_rank=3, process_set=static)
        assert obj == {"from": 3}
    # An optimizer averaging within a set.
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), process_set=mine)
    before = model.weight.detach().clone()
    model(torch.full((1, 2), float(me))).sum().backward()
    opt.step()
    mean_input = sum(mine.ranks) / 2.0
    assert torch.allclose(before - model.weight.detach(), torch.full((1, 2), mean_input))
    # The world still works beside the sets; removing them releases their rings.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="world").item() == 4
    assert hvd.remove_process_set(low) and hvd.remove_process_set(high)
    assert low.process_set_id is None and not hvd.remove_process_set(low)
    assert not hvd.remove_process_set(hvd.global_process_set)
    again = hvd.add_process_set([0, 1])  # the same ranks may form a set again
    if again.included():
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=again).item() == 2
    hvd.shutdown()
    assert static.process_set_id is None


def adasum_allreduce_and_optimizer():
    """op=hvd.Adasum: the allreduce against the pairwise formula in tree order, and
    DistributedOptimizer(op=Adasum) combining the ranks' SGD+momentum updates."""
    import numpy as np

    from tests.common.reference import reference_adasum
    hvd.init()
    me, size = hvd.rank(), hvd.size()

    def data(r, n, salt):
        rng = np.random.default_rng(100 * r + salt)
        return rng.normal(size=n) + (r + 1) * np.linspace(-1, 1, n)

    x = torch.from_numpy(data(me, 11, 0))
    got = hvd.allreduce(x, op=hvd.Adasum, name="adasum.t")
    want = reference_adasum([data(r, 11, 0) for r in range(size)])
    assert np.allclose(got.numpy(), want, rtol=1e-12, atol=1e-12), (got, want)
    # The optimizer: each rank's own SGD step (momentum 0.9), the deltas combined.
    torch.manual_seed(5)
    model = torch.nn.Linear(4, 3).double()
    start = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    deltas = []  # per rank, per parameter: what that rank's own SGD step would do
    for r in range(size):
        twin = torch.nn.Linear(4, 3).double()
        with torch.no_grad():
            for p, s in zip(twin.parameters(), start):
                p.copy_(s)
        twin(torch.from_numpy(data(r, 4, 1)).reshape(1, 4)).pow(2).sum().backward()
        torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9).step()
        deltas.append([(p - s).detach().numpy() for p, s in zip(twin.parameters(), start)])
    model(torch.from_numpy(data(me, 4, 1)).reshape(1, 4)).pow(2).sum().backward()
    opt.step()
    for i, (p, s) in enumerate(zip(model.parameters(), start)):
        want = s.numpy() + reference_adasum([deltas[r][i] for r in range(size)])
        assert np.allclose(p.detach().numpy(), want, rtol=1e-10, atol=1e-12), (i, p, want)
    try:
        with opt.skip_synchronize():
            pass
    except ValueError as e:
        assert "Adasum" in str(e)
    else:
        raise AssertionError("skip_synchronize was accepted with Adasum")
    hvd.shutdown()


def broadcast_optimizer_state_leaves_zero_gradients():
    """Horovod's rule: a fresh optimizer's trainable parameters come out of
    broadcast_optimizer_state with zero gradients (scripts go on to broadcast or clip
    them); an optimizer with state keeps its gradients and takes the root's state."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    torch.manual_seed(me)
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # (left without a gradient, as Horovod leaves it)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.bias.grad is None
    assert torch.equal(model.weight.grad, torch.zeros(2, 3)), model.weight.grad
    assert torch.equal(hvd.broadcast(model.weight.grad, 0, name="zero.grad"), torch.zeros(2, 3))
    # State present (a plain optimizer stepped on this rank's own gradient): the gradients
    # stay, the momentum becomes the root's (its first step's buffer is its gradient).
    plain = torch.nn.Linear(2, 2, bias=False)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.arange(2.0).reshape(1, 2) + me).pow(2).sum().backward()
    sgd.step()
    mine = plain.weight.grad.clone()
    hvd.broadcast_optimizer_state(sgd, root_rank=size - 1)
    assert torch.equal(plain.weight.grad, mine)
    root_grad = hvd.broadcast(mine, size - 1, name="root.grad")
    assert torch.equal(sgd.state_dict()["state"][0]["momentum_buffer"], root_grad)
    for bad in (None, [1.0, 2.0]):
        try:
            hvd.broadcast(bad, 0)
        except hvd.UsageError as e:
            assert "ringsync.torch.broadcast: tensor is" in str(e), e
        else:
            raise AssertionError(f"broadcast of {bad!r} was accepted")
    hvd.shutdown()


def _average_step_reference(model_seed, inputs, lr):
    """The weight of a Linear(3, 2) after one SGD step on the mean over `inputs` (one per
    rank) of each rank's gradient of sum(model(x))."""
    torch.manual_seed(model_seed)
    ref = torch.nn.Linear(3, 2)
    for x in inputs:
        (ref(x).sum() / len(inputs)).backward()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    return ref.weight.detach()


def named_parameters_as_horovod_takes_them():
    """Any iterable of (name, parameter) tuples names the gradients (a generator, a list,
    a tuple, dict.items()); what Horovod refuses is refused with its exception class."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    inputs = [torch.tensor([[1.0 + r, -2.0 * r, 0.5]]) for r in range(size)]
    forms = {"generator": lambda m: m.named_parameters(),
             "list": lambda m: list(m.named_parameters()),
             "tuple": lambda m: tuple(m.named_parameters()),
             "dict.items()": lambda m: dict(m.named_parameters()).items()}
    want = _average_step_reference(11, inputs, 0.5)
    for form, named in forms.items():
        torch.manual_seed(11)
        model = torch.nn.Linear(3, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=named(model))
        model(inputs[me]).sum().backward()
        opt.step()
        assert torch.allclose(model.weight.detach(), want, atol=1e-6), (form, model.weight)
    model = torch.nn.Linear(3, 2)
    refused = [(model.named_parameters, TypeError, "call it"),
               (7, TypeError, "got int"),
               (dict(model.named_parameters()), ValueError, "pass its .items()"),
               (list(model.parameters()), ValueError, "an item is Parameter"),
               ([("w", model.weight)], ValueError, "does not name every parameter"),
               ([("w", model.weight), ("w", model.bias)], ValueError, "duplicate names")]
    for given, cls, words in refused:
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=given)
        except cls as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"named_parameters={given!r} was accepted")
    hvd.shutdown()


def ranks_outside_the_optimizers_set_keep_their_gradients():
    """Horovod's rule: DistributedOptimizer(process_set=s) on a rank outside s reduces
    nothing; that rank steps on its own gradients. The members average among themselves."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    if size < 2:  # (every rank is in every set)
        hvd.shutdown()
        return
    members = hvd.add_process_set(list(range(size - 1)))  # all but the last rank
    inputs = [torch.tensor([[1.0 + r, -2.0 * r, 0.5 * r * r]]) for r in range(size)]
    group = members.ranks if members.included() else [me]
    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   process_set=members)
    model(inputs[me]).sum().backward()
    opt.synchronize()
    want_grad = sum(inputs[r] for r in group).expand(2, 3) / len(group)
    assert torch.allclose(model.weight.grad, want_grad), (me, model.weight.grad, want_grad)
    with opt.skip_synchronize():
        opt.step()
    want = _average_step_reference(5, [inputs[r] for r in group], 0.5)
    print(f"rank {me} (in the set: {members.included()}): weight {model.weight.tolist()}")
    assert torch.allclose(model.weight.detach(), want, atol=1e-6), (me, model.weight, want)
    opt.zero_grad()
    model(inputs[me]).sum().backward()
    opt.step()  # a second step, through step() itself
    hvd.remove_process_set(members)
    hvd.shutdown()
