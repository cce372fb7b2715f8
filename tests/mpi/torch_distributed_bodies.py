"""Rank programs for tests/mpi/test_torch_distributed.py: torch.distributed's collectives
on a backend given by name ("ringsync", or "gloo" to show that the checks test torch's
semantics), every result compared with a numpy reference computed from every rank's input.

Run by torchrun as a module (`python -m tests.mpi.torch_distributed_bodies BACKEND`), or
under mpirun through `under_mpirun` (ringsync.init() first: the world group then runs on
the job's MPI-built ring)."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import ringsync.torch.distributed  # noqa: F401  (registers "ringsync")
from tests.common.reference import assert_reduced, dtype_of, rank_input

TORCH_OPS = {"Sum": dist.ReduceOp.SUM, "Average": dist.ReduceOp.AVG,
             "Min": dist.ReduceOp.MIN, "Max": dist.ReduceOp.MAX,
             "Product": dist.ReduceOp.PRODUCT}
# What gloo itself lacks (torch's CPU reference backend): these run on ringsync only.
GLOO_LACKS_OPS = {"Average"}
FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int32", "int64", "uint8", "int8"]
SHAPES = [(1,), (7,), (3, 5), (1009,)]


def tensor(array):
    if array.dtype == dtype_of("bfloat16"):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).clone()
    return torch.from_numpy(np.array(array))


def array(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype_of("bfloat16"))
    return t.numpy()


def every_input(shape, dtype, op="Sum", salt=""):
    return [rank_input(r, shape, dtype, op, salt) for r in range(dist.get_world_size())]


def check_all_reduce(backend):
    rank = dist.get_rank()
    for dtype in FLOATS + INTS:
        for op in TORCH_OPS:
            if (backend == "gloo" and op in GLOO_LACKS_OPS) or (dtype in INTS and
                                                                 op == "Average"):
                continue
            for shape in SHAPES:
                inputs = every_input(shape, dtype, op)
                t = tensor(inputs[rank])
                work = dist.all_reduce(t, op=TORCH_OPS[op], async_op=shape == (7,))
                if work is not None:
                    work.wait()
                assert_reduced(array(t), inputs, op, what=f"all_reduce {op} {dtype} {shape}")


def check_non_contiguous_and_bitwise(backend):
    rank, size = dist.get_rank(), dist.get_world_size()
    inputs = every_input((6, 4), "float64")
    t = tensor(inputs[rank]).t()  # a transposed view: not contiguous
    dist.all_reduce(t)
    np.testing.assert_allclose(t.numpy(), sum(inputs).T, rtol=1e-12)
    ints = every_input((9,), "int64", salt="bits")
    for op, fold in ((dist.ReduceOp.BAND, np.bitwise_and), (dist.ReduceOp.BOR, np.bitwise_or),
                     (dist.ReduceOp.BXOR, np.bitwise_xor)):
        t = tensor(ints[rank])
        dist.all_reduce(t, op=op)
        np.testing.assert_array_equal(t.numpy(), fold.reduce(np.stack(ints)), err_msg=str(op))
    flags = [rank_input(r, (11,), "bool") for r in range(size)]
    for op, fold in ((dist.ReduceOp.SUM, np.logical_or), (dist.ReduceOp.PRODUCT, np.logical_and),
                     (dist.ReduceOp.MAX, np.logical_or), (dist.ReduceOp.MIN, np.logical_and)):
        t = torch.from_numpy(flags[rank].copy())
        dist.all_reduce(t, op=op)
        np.testing.assert_array_equal(t.numpy(), fold.reduce(np.stack(flags)), err_msg=str(op))
    if backend != "gloo":  # (gloo has no PREMUL_SUM)
        x = every_input((5,), "float64", salt="premul")
        t = tensor(x[rank])
        dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM(0.25) if hasattr(
            dist.ReduceOp, "PREMUL_SUM") else dist.ReduceOp.SUM)
        np.testing.assert_allclose(t.numpy(), sum(0.25 * v for v in x), rtol=1e-12)
        z = [np.array(v[:4] + 1j * v[1:], dtype=np.complex128) for v in x]
        t = torch.from_numpy(z[rank].copy())
        dist.all_reduce(t)
        np.testing.assert_allclose(t.numpy(), sum(z), rtol=1e-12)


def check_data_movement(backend):
    rank, size = dist.get_rank(), dist.get_world_size()
    for dtype in ["float32", "int64", "bfloat16", "uint8"]:
        inputs = every_input((2, 3), dtype, salt="move")
        # broadcast from the last rank
        t = tensor(inputs[rank])
        dist.broadcast(t, src=size - 1)
        np.testing.assert_array_equal(array(t), inputs[-1], err_msg=f"broadcast {dtype}")
        # all_gather (a list) and all_gather_into_tensor
        outs = [torch.empty_like(tensor(inputs[0])) for _ in range(size)]
        dist.all_gather(outs, tensor(inputs[rank]))
        for r in range(size):
            np.testing.assert_array_equal(array(outs[r]), inputs[r], err_msg=f"all_gather {r}")
        out = torch.empty((2 * size, 3), dtype=tensor(inputs[0]).dtype)
        dist.all_gather_into_tensor(out, tensor(inputs[rank]))
        np.testing.assert_array_equal(array(out), np.concatenate(inputs))
        # gather / scatter at root 0
        got = [torch.empty_like(tensor(inputs[0])) for _ in range(size)] if rank == 0 else None
        dist.gather(tensor(inputs[rank]), got, dst=0)
        if rank == 0:
            for r in range(size):
                np.testing.assert_array_equal(array(got[r]), inputs[r], err_msg=f"gather {r}")
        mine = torch.empty_like(tensor(inputs[0]))
        pieces = [tensor(rank_input(0, (2, 3), dtype, salt=f"scatter{r}"))
                  for r in range(size)] if rank == 0 else None
        dist.scatter(mine, pieces, src=0)
        np.testing.assert_array_equal(array(mine), rank_input(0, (2, 3), dtype,
                                                              salt=f"scatter{rank}"))


def check_reductions_that_scatter(backend):
    rank, size = dist.get_rank(), dist.get_world_size()
    for op in ["Sum", "Max"] + ([] if backend == "gloo" else ["Average"]):
        inputs = every_input((size * 4,), "float64", op, salt="rs")
        out = torch.empty(4, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, tensor(inputs[rank]), op=TORCH_OPS[op])
        assert_reduced(out.numpy(), [x[rank * 4:(rank + 1) * 4] for x in inputs], op,
                       what=f"reduce_scatter_tensor {op}")
        lists = [[rank_input(r, (3,), "float32", op, f"rsl{j}") for j in range(size)]
                 for r in range(size)]
        out = torch.empty(3)
        dist.reduce_scatter(out, [tensor(x) for x in lists[rank]], op=TORCH_OPS[op])
        assert_reduced(out.numpy(), [lists[r][rank] for r in range(size)], op,
                       what=f"reduce_scatter {op}")
        x = every_input((5,), "float32", op, salt="reduce")
        t = tensor(x[rank])
        dist.reduce(t, dst=size - 1, op=TORCH_OPS[op])
        if rank == size - 1:
            assert_reduced(t.numpy(), x, op, what=f"reduce {op}")


def check_all_to_all(backend):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.arange(size * 2, dtype=torch.float64) + 100 * rank
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    want = np.concatenate([np.arange(rank * 2, rank * 2 + 2) + 100 * r for r in range(size)])
    np.testing.assert_array_equal(y.numpy(), want)
    # uneven splits: rank r sends r + j + 1 rows to rank j
    send = [r + j + 1 for r in range(size) for j in range(size)]
    rows = [[send[r * size + j] for j in range(size)] for r in range(size)]
    x = torch.full((sum(rows[rank]), 2), float(rank))
    recv = [rows[r][rank] for r in range(size)]
    y = torch.empty((sum(recv), 2))
    dist.all_to_all_single(y, x, output_split_sizes=recv, input_split_sizes=rows[rank])
    np.testing.assert_array_equal(y.numpy()[:, 0], np.repeat(np.arange(size, dtype=float), recv))
    outs = [torch.empty(3, dtype=torch.int64) for _ in range(size)]
    dist.all_to_all(outs, [torch.full((3,), 10 * rank + j, dtype=torch.int64)
                           for j in range(size)])
    for r in range(size):
        np.testing.assert_array_equal(outs[r].numpy(), np.full(3, 10 * r + rank))


def check_messages_and_objects(backend):
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if size > 1:
        right, left = (rank + 1) % size, (rank - 1) % size
        ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), right, tag=3),
               dist.P2POp(dist.irecv, torch.empty(4), left, tag=3)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        np.testing.assert_array_equal(ops[1].tensor.numpy(), np.full(4, float(left)))
        if rank == 0:
            for tag in (7, 8):
                dist.send(torch.full((2,), float(tag)), 1, tag=tag)
        elif rank == 1:
            got = torch.empty(2)
            dist.recv(got, 0, tag=7)
            np.testing.assert_array_equal(got.numpy(), [7.0, 7.0])
            dist.recv(got, 0, tag=8)
            np.testing.assert_array_equal(got.numpy(), [8.0, 8.0])
    everyone = [None] * size
    dist.all_gather_object(everyone, {"rank": rank, "text": "x" * rank})
    assert everyone == [{"rank": r, "text": "x" * r} for r in range(size)], everyone
    objects = [f"from {rank}", rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(objects, src=0)
    assert objects == ["from 0", 0], objects


def check_groups(backend):
    rank, size = dist.get_rank(), dist.get_world_size()
    members = list(range(0, size, 2))  # the even ranks
    group = dist.new_group(members)
    if rank in members:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(r + 1 for r in members), (t, members)
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=members[-1], group=group)  # (the global rank, as torch takes)
        assert b.item() == members[-1], b


def check_subgroups_and_meshes(backend):
    """new_subgroups, both dimensions of a 2-D DeviceMesh, DTensor redistributions over
    it, and asynchronous calls of disjoint groups in flight together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    rank, size = dist.get_rank(), dist.get_world_size()
    sub, _ = dist.new_subgroups(group_size=2 if size % 2 == 0 else size)
    mesh = init_device_mesh("cpu", mesh_shape(size), mesh_dim_names=("dp", "tp"))
    groups = [sub, mesh.get_group("dp"), mesh.get_group("tp")]
    works = []
    for group in groups:
        members = dist.get_process_group_ranks(group)
        t = torch.tensor([float(rank + 1)] * 3)
        works.append((dist.all_reduce(t, group=group, async_op=True), t, members))
    for work, t, members in works:
        work.wait()
        assert t.tolist() == [float(sum(r + 1 for r in members))] * 3, (t, members)
    x = torch.arange(24.0).reshape(6, 4)
    for placements in ([Shard(0), Replicate()], [Shard(0), Shard(1)],
                       [Replicate(), Shard(1)]):
        d = distribute_tensor(x, mesh, placements)
        assert torch.equal((d * 2).full_tensor(), x * 2), placements
        back = d.redistribute(mesh, [Replicate(), Replicate()]).to_local()
        assert torch.equal(back, x), placements


def mesh_shape(size):
    """(replicas, shards) of a 2-D mesh over `size` ranks."""
    return (2, size // 2) if size % 2 == 0 else (size, 1)


def model_and_batches(steps=4, batch=12, seed=0):
    """A float64 MLP and `steps` global batches (every rank builds the same ones)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = model.double()
    data = [(torch.randn(batch, 5, dtype=torch.float64), torch.randn(batch, 3, dtype=torch.float64))
            for _ in range(steps)]
    return model, data


def train(model, data, shard=lambda x: x, accumulate=None, lr=0.1):
    """SGD with momentum on mean squared error over each batch (this rank's shard of it).
    accumulate(model): a context for the first half of a batch (DDP's no_sync)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in data:
        x, y = shard(x), shard(y)
        opt.zero_grad()
        if accumulate is None:
            torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            half = x.shape[0] // 2
            with accumulate(model):
                (torch.nn.functional.mse_loss(model(x[:half]), y[:half]) / 2).backward()
            (torch.nn.functional.mse_loss(model(x[half:]), y[half:]) / 2).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_training(backend):
    """DDP (plain; no_sync; bucket views with a static graph) and FSDP2 end where one
    process training on the whole batch ends, to float64 round-off."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, size = dist.get_rank(), dist.get_world_size()

    def shard(t):
        return t.chunk(size)[rank]

    def halves_shard(t):  # (each half of the batch split over the ranks: as no_sync sees it)
        half = t.shape[0] // 2
        return torch.cat([t[:half].chunk(size)[rank], t[half:].chunk(size)[rank]])

    model, data = model_and_batches()
    reference = train(model, data)
    variants = {
        "ddp": lambda m: train(DDP(m), data, shard),
        "ddp no_sync": lambda m: train(DDP(m), data, halves_shard, lambda d: d.no_sync()),
        "ddp bucket views, static graph": lambda m: train(
            DDP(m, gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=0.001),
            data, shard),
        "fsdp2": lambda m: train_fsdp(fully_shard, m, data, shard),
    }
    for name, run in variants.items():
        fresh, _ = model_and_batches()
        got = run(fresh)
        for i, (a, b) in enumerate(zip(got, reference)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12,
                                       err_msg=f"{name}: parameter {i} on rank {rank}")


def train_fsdp(fully_shard, model, data, shard, **options):
    train(fully_shard_layers(fully_shard, model, **options), data, shard)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def digest(params) -> str:
    import hashlib
    return hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()[:16]


def fully_shard_layers(fully_shard, model, **options):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def train_joined(model, data, rank, size, lr=0.1):
    """Uneven inputs: rank r trains on the first len(data) - r batches (its shard of
    them), under DDP's join; on one process (model not DDP), the joined ranks' shards
    count as zeros, as DDP's join averages over the initial world size."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if not isinstance(model, DDP):
        for k, (x, y) in enumerate(data):
            opt.zero_grad()
            active = range(min(size, len(data) - k))
            sum(torch.nn.functional.mse_loss(model(x.chunk(size)[r]), y.chunk(size)[r])
                for r in active).div(size).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    with Join([model]):
        for x, y in data[:len(data) - rank]:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x.chunk(size)[rank]),
                                         y.chunk(size)[rank]).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def checkpoint_round_trip(fully_shard, model, data, shard):
    """FSDP2 training, torch.distributed.checkpoint save, load into a model that started
    elsewhere (seed 1): the loaded parameters."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    train(fully_shard_layers(fully_shard, model), data, shard)
    path = [tempfile.mkdtemp(prefix="dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path[0])
    fresh = fully_shard_layers(fully_shard, model_and_batches(seed=1)[0])
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path[0])
    fresh.load_state_dict(state["model"])
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil
        shutil.rmtree(path[0])
    return [p.full_tensor().detach().clone() for p in fresh.parameters()]


def train_zero(model, data, shard, lr=0.1):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=lr,
                                  momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(shard(x)), shard(y)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def user_code_variants(rank, size):
    """name -> (run(fresh model, data) -> parameters, what one process ends with, rtol):
    DDP's communication hooks, join, ZeroRedundancyOptimizer, FSDP2's options and
    torch.distributed.checkpoint, as their users write them. (DDP's bf16 hook is left
    out: torch itself allows it only on NCCL.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    def shard(t):
        return t.chunk(size)[rank]

    def hooked(state, hook):
        def run(model, data):
            ddp = DDP(model)
            ddp.register_comm_hook(state() if state else None, hook)
            return train(ddp, data, shard)
        return run

    def power_sgd():  # (compressing from the third step on: rank-1 approximations)
        return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                           start_powerSGD_iter=2, min_compression_rate=0.0)
    plain = "the same as one process"
    return {
        "ddp fp16 compress hook": (hooked(None, default_hooks.fp16_compress_hook), plain,
                                   1e-3),
        "ddp PowerSGD hook": (hooked(power_sgd, powerSGD_hook.powerSGD_hook), None, None),
        "ddp join (uneven inputs)": (lambda m, d: train_joined(DDP(m), d, rank, size),
                                     "joined", 1e-10),
        "ZeroRedundancyOptimizer": (lambda m, d: train_zero(DDP(m), d, shard), plain, 1e-10),
        "fsdp2 reshard_after_forward=False": (lambda m, d: train_fsdp(
            fully_shard, m, d, shard, reshard_after_forward=False), plain, 1e-10),
        "fsdp2 mixed precision (float32 compute)": (lambda m, d: train_fsdp(
            fully_shard, m, d, shard, mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.float32, reduce_dtype=torch.float32)), plain, 1e-5),
        "fsdp2 + torch.distributed.checkpoint": (lambda m, d: checkpoint_round_trip(
            fully_shard, m, d, shard), plain, 1e-10),
        "fsdp2 HSDP (2-D mesh)": (lambda m, d: train_fsdp(
            fully_shard, m, d, shard, mesh=hsdp_mesh(size)), plain, 1e-10),
    }


def hsdp_mesh(size):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", mesh_shape(size), mesh_dim_names=("replicate", "shard"))


def check_user_code(backend):
    """Each variant ends with the same parameters on every rank, near what one process
    ends with (PowerSGD: a lossy approximation, so no reference here); each prints a
    digest of its parameters, which test_user_code_ends_where_gloo_does compares across
    backends."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model, data = model_and_batches()
    references = {"the same as one process": train(model, data),
                  "joined": train_joined(model_and_batches()[0], data, rank, size)}
    for name, (run, reference, rtol) in user_code_variants(rank, size).items():
        got = run(model_and_batches()[0], data)
        flat = torch.cat([p.reshape(-1) for p in got])
        everyone = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(everyone, flat)
        for r, theirs in enumerate(everyone):
            assert torch.equal(theirs, flat), f"{name}: rank {r}'s parameters differ"
        if reference is not None:
            want = torch.cat([p.reshape(-1) for p in references[reference]])
            np.testing.assert_allclose(flat.numpy(), want.numpy(), rtol=rtol, atol=rtol / 10,
                                       err_msg=f"{name} on rank {rank}")
        print(f"--- digest {name}: {digest(got)} (rank {rank})", flush=True)


CHECKS = [check_all_reduce, check_non_contiguous_and_bitwise, check_data_movement,
          check_reductions_that_scatter, check_all_to_all, check_messages_and_objects,
          check_groups, check_subgroups_and_meshes, check_training, check_user_code]


def run_checks(backend):
    for check in CHECKS:
        print(f"--- {check.__name__} ({backend}, rank {dist.get_rank()})", flush=True)
        check(backend)
    dist.barrier()
    print(f"--- every check passed ({backend}, rank {dist.get_rank()})", flush=True)
    dist.destroy_process_group()


def under_torchrun(backend):
    dist.init_process_group(backend)
    assert dist.get_backend() == backend
    assert dist.get_rank() == int(os.environ["RANK"])
    run_checks(backend)


def under_mpirun(path):
    """ringsync.init() first: the world group runs on the job's ring (built over MPI)."""
    import ringsync
    ringsync.init()
    dist.init_process_group("ringsync", init_method=f"file://{path}", rank=ringsync.rank(),
                            world_size=ringsync.size())
    assert dist.group.WORLD.comm is ringsync._comm(), "the world group must reuse the job's ring"
    run_checks("ringsync")
    ringsync.shutdown()


def late_rank_times_out(backend, marker):
    """Rank 1 comes late to an all_reduce: it waits until rank 0 has left the call (the
    marker file rank 0 writes), up to 60 s; with a 4 s group timeout every waiting rank
    gets torch's DistBackendError (not a hang), naming the rank that did not come."""
    import time
    from datetime import timedelta
    dist.init_process_group(backend, timeout=timedelta(seconds=4))
    rank = dist.get_rank()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("--- rank 1 done waiting", flush=True)
        return
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(3))
    except dist.DistBackendError as exc:
        waited = time.monotonic() - start
        print(f"--- rank {rank} raised DistBackendError after {waited:.1f} s: {exc}", flush=True)
        assert waited < 15, waited
        assert "1" in str(exc), exc
        return
    finally:
        open(marker, "w").close()
    raise AssertionError(f"rank {rank}: all_reduce returned without rank 1")


def a_dead_rank_fails_every_pending_call(backend):
    """The last rank dies (SIGKILL) after the first all_reduce, while the others have a
    large asynchronous all_reduce and a small blocking one to make with it: with a 60 s
    group timeout, both fail on every survivor with DistBackendError well before it,
    naming the dead rank; none hangs."""
    import signal
    import time
    from datetime import timedelta
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.ones(2))
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    for what, call in (("async", lambda: dist.all_reduce(torch.ones(1 << 20), async_op=True)
                        .wait()),
                       ("blocking", lambda: dist.all_reduce(torch.ones(3)))):
        try:
            call()
        except dist.DistBackendError as exc:
            waited = time.monotonic() - start
            print(f"--- rank {rank} {what}: DistBackendError after {waited:.1f} s: {exc}",
                  flush=True)
            assert waited < 30, waited
            assert f"rank {size - 1}" in str(exc), exc
        else:
            raise AssertionError(f"rank {rank}: the {what} all_reduce returned without "
                                 f"rank {size - 1}")
    dist.destroy_process_group()  # (a broken group shuts down too)
    print(f"--- rank {rank}: the group shut down", flush=True)


def exits_without_destroying_its_group(backend):
    """A script that never calls destroy_process_group (most do not): blocking and
    asynchronous all_reduces, then the end of the program."""
    dist.init_process_group(backend)
    t = torch.ones(10)
    dist.all_reduce(t)
    dist.all_reduce(torch.ones(1 << 20), async_op=True).wait()
    assert t.tolist() == [float(dist.get_world_size())] * 10, t
    print(f"--- rank {dist.get_rank()} leaves its group as it is", flush=True)


def different_collectives_fail_naming_both(backend):
    """Rank 0 calls all_reduce, the others broadcast: every rank gets an error that names
    both calls (gloo would hang or mix the data up), and the group still works after."""
    dist.init_process_group(backend)
    rank = dist.get_rank()
    t = torch.ones(4)
    try:
        if rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
    except dist.DistBackendError as exc:
        text = str(exc)
        print(f"--- rank {rank} raised {type(exc).__name__}: {text}", flush=True)
        assert "allreduce" in text and "broadcast" in text, text
    else:
        raise AssertionError(f"rank {rank}: mismatched collectives did not fail")
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)  # the next call works on every rank
    assert t.tolist() == [float(sum(range(dist.get_world_size())))] * 2, t
    print(f"--- rank {rank}: the next all_reduce works", flush=True)
    dist.destroy_process_group()


def bad_arguments(rank, size):
    """(name, call) pairs: call(bad) runs one collective, with arguments that rank
    size-1 gets wrong where bad is True."""
    def gather_into_tensor(bad):
        dist.all_gather_into_tensor(torch.zeros(3 * size + bad), torch.ones(3))

    def all_to_all_single(bad):
        splits = [2] * size
        splits[0] += bad  # (the split sizes no longer add up to the input's rows)
        dist.all_to_all_single(torch.zeros(2 * size), torch.ones(2 * size),
                               input_split_sizes=splits)

    def scatter(bad):  # (the root is the bad rank: it gives one input too few)
        inputs = [torch.full((2,), float(i)) for i in range(size - bad)]
        dist.scatter(torch.zeros(2), inputs if rank == size - 1 else None, src=size - 1)

    def broadcast(bad):  # (a dtype the core cannot carry)
        dist.broadcast(torch.zeros(4, dtype=torch.float8_e4m3fn if bad else torch.float32),
                       src=0)
    return [("all_gather_into_tensor", gather_into_tensor),
            ("all_to_all_single", all_to_all_single), ("scatter", scatter),
            ("broadcast", broadcast)]


def bad_arguments_fail_on_every_rank(backend):
    """One rank's bad arguments (checked before they reach the ring) refuse the call on
    the ring: that rank gets a ValueError naming what is wrong, every other rank a
    DistBackendError at once (not after the 60 s group timeout), and the next all_reduce
    works on every rank."""
    import time
    from datetime import timedelta
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    bad = rank == size - 1
    for name, call in bad_arguments(rank, size):
        start = time.monotonic()
        try:
            call(bad)
        except (ValueError, dist.DistBackendError) as exc:
            waited = time.monotonic() - start
            kind = "DistBackendError" if isinstance(exc, dist.DistBackendError) else \
                "ValueError"
            print(f"--- rank {rank} {name}: {kind} after {waited:.1f} s: {exc}", flush=True)
            assert kind == ("ValueError" if bad else "DistBackendError"), (name, rank, exc)
            assert waited < 30, (name, rank, waited)
        else:
            raise AssertionError(f"rank {rank}: {name} with bad arguments did not fail")
        t = torch.arange(3, dtype=torch.float64) + 10.0 * rank
        dist.all_reduce(t)
        want = [size * i + 10.0 * sum(range(size)) for i in range(3)]
        assert t.tolist() == want, (name, rank, t.tolist(), want)
        print(f"--- rank {rank} {name}: the next all_reduce works", flush=True)
    dist.destroy_process_group()


def meshes(backend):
    """check_subgroups_and_meshes and HSDP training alone (on 4 ranks: a 2 x 2 mesh)."""
    dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    check_subgroups_and_meshes(backend)
    model, data = model_and_batches()
    reference = train(model, data)
    run, _, rtol = user_code_variants(rank, size)["fsdp2 HSDP (2-D mesh)"]
    got = run(model_and_batches()[0], data)
    for i, (a, b) in enumerate(zip(got, reference)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=rtol, atol=rtol / 10,
                                   err_msg=f"HSDP: parameter {i} on rank {rank}")
    print(f"--- meshes done ({backend}, rank {rank})", flush=True)
    dist.destroy_process_group()


def user_code(backend):
    """check_user_code alone (its digests compared across backends)."""
    dist.init_process_group(backend)
    check_user_code(backend)
    print(f"--- user code done ({backend}, rank {dist.get_rank()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    program = globals()[sys.argv[2]] if len(sys.argv) > 2 else under_torchrun
    program(sys.argv[1], *sys.argv[3:])
