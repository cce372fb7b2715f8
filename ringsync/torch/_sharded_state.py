"""The optimizer state of a ShardedOptimizer's shards (sharded.py) and its translations:
this rank's shards of the param groups and their master copies, the shard optimizer built
over them, and the forms its state travels in — a full torch-style state dict (in, by
load_state_dict; out, assembled from every rank's shards by consolidate_state_dict) and a
checkpoint's parts (ringsync.torch.checkpoint). No collectives here: sharded.py makes them.

Also the bookkeeping ShardedOptimizer and ShardedModule share (held_bytes)."""
import copy

import torch

from ringsync.errors import CheckpointError, UsageError

_WIDENED = (torch.float16, torch.bfloat16)  # their master copies are float32


def held_bytes(tensors):
    """Bytes of the distinct storages under `tensors` (None entries skipped)."""
    storages = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            storages[(s.data_ptr(), str(s.device), s.nbytes())] = s.nbytes()
    return sum(storages.values())


def master_dtype(dtype):
    return torch.float32 if dtype in _WIDENED else dtype


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def hyperparameters(group):
    return {k: v for k, v in group.items() if k != "params"}


def flat_ranges(tensors, ranges, base):
    """Elements [a - base, b - base) of `tensors` laid end to end, for each (a, b)."""
    pieces = [_flat(tensors, a - base, b - base) for a, b in ranges]
    return torch.cat(pieces) if pieces else tensors[0].new_empty(0)


def _flat(tensors, a, b):
    """Elements [a, b) of `tensors` laid end to end, without building the whole."""
    pieces, off = [], 0
    for t in tensors:
        lo, hi = max(a, off), min(b, off + t.numel())
        if lo < hi:
            pieces.append(t.reshape(-1)[lo - off: hi - off])
        off += t.numel()
    return torch.cat(pieces) if pieces else tensors[0].new_empty(0)


class Shard:
    """This rank's part of one param group's parameters of one dtype in one bucket: where
    the group occupies [gstart, gstop) of run `run` and this bucket's part of it is
    [start, stop), the elements `ranges` of that (the rank's piece of the bucket,
    clipped), which start at element `at` of the rank's pieces. (One master tensor per
    bucket keeps the optimizer's temporaries, one master-sized tensor at a time, small.)"""

    def __init__(self, group, run, span, group_span, rank):
        self.group, self.run = group, run
        (self.start, self.stop), (self.gstart, self.gstop) = span, group_span
        self.bucket = next(k for k, (a, b) in enumerate(run.spans) if a <= self.start < b)
        self.ranges = self.ranges_of(rank)
        self.numel = sum(b - a for a, b in self.ranges)
        self.at = run.owned_before(rank, self.start)
        self.master = None  # the torch.nn.Parameter the inner optimizer steps
        self.is_view = False  # whether master is a view of the parameters themselves

    def params(self):
        """The group's parameters of this dtype in this bucket (not only this rank's)."""
        return [p for p, off in zip(self.run.params, self.run.offsets)
                if self.start <= off < self.stop]

    def ranges_of(self, rank):
        clipped = [(max(a, self.start), min(b, self.stop)) for a, b in self.run.pieces(rank)]
        return [(a, b) for a, b in clipped if a < b]

    def by_range(self, values, rank=None, base=None):
        """(a, b, the part of `values` holding elements [a, b)) for each of rank's ranges
        (this rank's by default), where `values` holds the rank's elements end to end and
        a, b count from `base` (the group's start by default)."""
        at, base = 0, self.gstart if base is None else base
        for a, b in self.ranges if rank is None else self.ranges_of(rank):
            yield a - base, b - base, values[at: at + b - a]
            at += b - a

    def read(self, reader, key, like):
        """This rank's elements of checkpoint entry `key` (of the whole group's size)."""
        total = self.gstop - self.gstart
        parts = [reader.range(key, a - self.gstart, b - self.gstart, total)
                 for a, b in self.ranges]
        return torch.cat(parts) if parts else like.new_empty(0)

    def key(self):
        """The checkpoint entries of this shard's group and dtype start with this."""
        return f"optimizer.g{self.group}.{dtype_name(self.run.dtype)}"


def make_shards(groups, runs, rank, host, pin, in_place):
    """This rank's shards of every param group (in group, then dtype, then bucket order),
    each with its master copy: with in_place, where the parameters' dtype is the master
    dtype, a view of the parameters themselves (each run laid end to end); else a copy on
    `host` (pinned if `pin`). runs: dtype -> the run of the trainable parameters of that
    dtype (sharded.py's _Run)."""
    shards, position = [], {d: 0 for d in runs}
    for gi, group in enumerate(groups):
        for dtype, run in runs.items():
            members = [p for p in group["params"] if p.requires_grad and p.dtype is dtype]
            if not members:
                continue
            start = position[dtype]
            position[dtype] = stop = start + sum(p.numel() for p in members)
            for a, b in run.spans:
                if max(a, start) < min(b, stop):
                    shard = Shard(gi, run, (max(a, start), min(b, stop)), (start, stop), rank)
                    _give_master(shard, host, pin, in_place)
                    shards.append(shard)
    return shards


def _give_master(shard, host, pin, in_place):
    """The shard's master copy: a view of the flat parameters (the optimizer steps them in
    place, as ZeroRedundancyOptimizer steps its own parameters), or a copy widened to fp32
    for fp16/bf16 and kept on `host` for offload."""
    run = shard.run
    a, b = shard.ranges[0] if shard.ranges else (shard.start, shard.start)
    values = run.flat.detach()[a: b]
    shard.is_view = in_place and master_dtype(run.dtype) == run.dtype
    if not shard.is_view:
        values = values.to(device=host, dtype=master_dtype(run.dtype), copy=True)
        values = values.pin_memory() if pin else values
    shard.master = torch.nn.Parameter(values)


def make_inner(optimizer, shards):
    """A new optimizer of optimizer's class over the shards' master copies, with each param
    group's hyperparameters."""
    groups = [dict(hyperparameters(g), params=[s.master for s in shards if s.group == gi])
              for gi, g in enumerate(optimizer.param_groups)]
    cls = type(optimizer)
    try:
        return cls(groups, **optimizer.defaults)
    except (TypeError, ValueError) as e:
        raise UsageError(f"ShardedOptimizer rebuilds the optimizer over this rank's shard "
                         f"as {cls.__name__}(param_groups, **defaults), which failed: {e}") \
            from e


def _elementwise(key, values, params):
    """Whether an optimizer state entry holds one value per parameter element (momentum,
    exp_avg) rather than one per tensor (Adam's step): shaped like every parameter that
    has it, and not a 'step' of scalar parameters."""
    if not all(v is None or torch.is_tensor(v) and v.shape == p.shape
               for v, p in zip(values, params)):
        return False
    return key != "step" or any(p.dim() > 0 for v, p in zip(values, params) if v is not None)


class ShardedState:
    """The state of the shard optimizer `inner` (over this rank's `shards` of the wrapped
    `optimizer`'s parameters `params`) and its translations. At stage 3 there are no
    shards and inner is the wrapped optimizer itself (only the hyperparameters pass)."""

    def __init__(self, optimizer, inner, shards, params):
        self.optimizer, self.inner, self.shards, self.params = optimizer, inner, shards, params

    def pass_hyperparameters(self):
        """The wrapped optimizer's hyperparameters (an LR scheduler's) to the shard one."""
        for mine, inner in zip(self.optimizer.param_groups, self.inner.param_groups):
            inner.update(hyperparameters(mine))

    def take_hyperparameters(self):
        """The shard optimizer's hyperparameters (as just loaded) to the wrapped one."""
        for mine, inner in zip(self.optimizer.param_groups, self.inner.param_groups):
            mine.update(hyperparameters(inner))

    def _inner_dict(self, state, groups):
        """A state dict for the shard optimizer: state by shard, groups' hyperparameters."""
        order = {s.master: i for i, s in enumerate(self.shards)}
        return {"state": state,
                "param_groups": [dict(hyperparameters(g),
                                      params=[order[m] for m in inner["params"]])
                                 for g, inner in zip(groups, self.inner.param_groups)]}

    # ---- a full torch-style state dict ----

    def load_full(self, full):
        """This rank's slices of a full state dict (the unsharded optimizer's) into the
        shard optimizer."""
        self.inner.load_state_dict(self._slice_full(full))

    def _slice_full(self, full):
        groups = full["param_groups"]
        if len(groups) != len(self.optimizer.param_groups) or \
                [len(g["params"]) for g in groups] != \
                [len(g["params"]) for g in self.optimizer.param_groups]:
            raise UsageError("ShardedOptimizer.load_state_dict: the state dict's param groups "
                             "do not match the optimizer's (group count or sizes differ)")
        ids = [i for g in groups for i in g["params"]]
        state_of = {p: full["state"].get(i) for p, i in zip(self.params, ids)}
        state = {}
        for si, s in enumerate(self.shards):
            params = s.params()
            stated = [p for p in params if state_of.get(p) is not None]
            if not stated:
                continue
            entry = {}
            for key in dict.fromkeys(k for p in stated for k in state_of[p]):
                values = [(state_of.get(p) or {}).get(key) for p in params]
                like = next(v for v in values if v is not None)
                if _elementwise(key, values, params):
                    whole = [v if v is not None else torch.zeros(p.shape, dtype=like.dtype)
                             for v, p in zip(values, params)]
                    entry[key] = flat_ranges(whole, s.ranges, s.start) \
                        .to(s.master.device).clone()
                else:  # (one per tensor, such as Adam's step: the first parameter's)
                    entry[key] = like.clone() if torch.is_tensor(like) else copy.deepcopy(like)
            state[si] = entry
        return self._inner_dict(state, groups)

    def mine(self):
        """This rank's shard state, on the host, by shard number (what it sends to
        consolidate)."""
        return {i: {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in
                    self.inner.state.get(s.master, {}).items()}
                for i, s in enumerate(self.shards)}

    def consolidated(self, everyone):
        """The full state dict, as the unsharded optimizer's state_dict() would give it,
        from every rank's mine() (in rank order)."""
        index = {p: i for i, p in enumerate(self.params)}
        state = {}
        for si, s in enumerate(self.shards):
            parts = [part[si] for part in everyone]
            keys = dict.fromkeys(k for st in parts for k in st)
            params = s.params()
            sizes = [sum(b - a for a, b in s.ranges_of(r)) for r in range(len(parts))]
            for key in keys:
                pieces = [st.get(key) for st in parts]
                if all(v is None or torch.is_tensor(v) and v.dim() == 1 and v.numel() == n
                       for v, n in zip(pieces, sizes)):
                    like = next(v for v in pieces if v is not None)
                    flat = like.new_zeros(s.stop - s.start)
                    for r, v in enumerate(pieces):
                        for a, b, piece in s.by_range(v, r, s.start) if v is not None else ():
                            flat[a: b] = piece
                    off = s.start
                    for p in params:
                        state.setdefault(index[p], {})[key] = \
                            flat[off - s.start: off - s.start + p.numel()].view(p.shape).clone()
                        off += p.numel()
                else:
                    value = next(v for v in pieces if v is not None)
                    for p in params:
                        state.setdefault(index[p], {})[key] = \
                            value.clone() if torch.is_tensor(value) else value
        groups, start = [], 0
        for g in self.optimizer.param_groups:
            groups.append(dict(hyperparameters(g),
                               params=list(range(start, start + len(g["params"])))))
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    # ---- checkpoints (ringsync.torch.checkpoint), stages 1 and 2 ----

    def layout(self):
        """Each param group's size per dtype (whatever the buckets)."""
        return [list(k) for k in dict.fromkeys((s.key(), s.gstop - s.gstart)
                                              for s in self.shards)]

    def save_parts(self, parts, rank):
        """This rank's slices of the master copies and of the per-element state into a
        checkpoint, per-tensor state whole; rank 0 adds the layout and hyperparameters."""
        self.pass_hyperparameters()
        kinds = {}
        for s in self.shards:
            key, total = s.key(), s.gstop - s.gstart
            for a, _, piece in s.by_range(s.master):
                parts.add_piece(f"{key}.master", piece, a, total)
            for k, v in self.inner.state.get(s.master, {}).items():
                elementwise = torch.is_tensor(v) and v.shape == s.master.shape
                if elementwise:
                    for a, _, piece in s.by_range(v):
                        parts.add_piece(f"{key}.{k}", piece, a, total)
                else:
                    parts.whole[f"{key}.{k}"] = v.detach().cpu().clone() \
                        if torch.is_tensor(v) else v
                kinds.setdefault(key, {})[k] = "piece" if elementwise else "whole"
        parts.whole["optimizer.kinds"] = kinds
        if rank == 0:
            parts.whole["optimizer.layout"] = self.layout()
            parts.whole["optimizer.groups"] = [hyperparameters(g)
                                               for g in self.optimizer.param_groups]

    def load_parts(self, reader):
        """This rank's slices from a checkpoint saved on any number of ranks (the model's
        parameters are loaded separately)."""
        saved = reader.whole("optimizer.layout")
        if saved != self.layout():
            raise CheckpointError(f"ringsync.checkpoint: the optimizer's layout differs from "
                                  f"the saved one (saved {saved}, here {self.layout()})")
        kinds, state = reader.whole("optimizer.kinds"), {}
        for si, s in enumerate(self.shards):
            key = s.key()
            with torch.no_grad():
                s.master.copy_(s.read(reader, f"{key}.master", s.master))
            # (per-tensor values cloned: every bucket's shard of a group reads the same one,
            # and torch's optimizers update such state, Adam's step, in place)
            entry = {k: s.read(reader, f"{key}.{k}", s.master) if kind == "piece"
                     else copy.deepcopy(reader.whole(f"{key}.{k}"))
                     for k, kind in kinds.get(key, {}).items()}
            if entry:
                state[si] = entry
        for mine, hyper in zip(self.optimizer.param_groups, reader.whole("optimizer.groups")):
            mine.update(hyper)
        self.inner.load_state_dict(self._inner_dict(state, self.optimizer.param_groups))
