"""Elastic training with PyTorch: TorchState and ElasticSampler (see ringsync.elastic).

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            for batch_idx, (x, y) in enumerate(loader):  # what is left of the epoch
                ...
                state.sampler.record_batch(batch_idx, batch_size)
                if batch_idx % 10 == 9:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
"""
import copy
import math
from typing import Iterator, List

import torch

import ringsync as _rs
from ringsync.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                              run)  # (the module's API)

from .functions import broadcast_optimizer_state, broadcast_parameters


class TorchState(ObjectState):
    """A model's parameters and buffers, an optimizer's state (a DistributedOptimizer
    or a plain one), and any keyword values, as one elastic State."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        super().__init__(**kwargs)

    def snapshot(self):
        return {
            "model": _clone(self.model.state_dict()) if self.model is not None else None,
            "optimizer": (copy.deepcopy(self.optimizer.state_dict())
                          if self.optimizer is not None else None),
            "objects": super().snapshot(),
        }

    def load_snapshot(self, snapshot) -> None:
        if self.model is not None:
            self.model.load_state_dict(snapshot["model"])
        if self.optimizer is not None:
            self._drop_pending_reductions()
            self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        super().load_snapshot(snapshot["objects"])

    def broadcast_state(self, root_rank: int) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank, prefix="elastic.model")
        if self.optimizer is not None:
            self._drop_pending_reductions()
            broadcast_optimizer_state(self.optimizer, root_rank)
        super().broadcast_state(root_rank)

    def _drop_pending_reductions(self):
        """Gradient reductions started on the ring that failed will never complete."""
        reset = getattr(self.optimizer, "reset_pending", None)
        if reset is not None:
            reset()


def _clone(state_dict):
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state_dict.items()}


class ElasticSampler(torch.utils.data.Sampler):
    """Shards a dataset over the current ranks and, after a recovery, reshards the
    samples of the epoch that no rank has processed yet over the new rank set.

    Call record_batch(batch_idx, batch_size) after each batch (batch_idx counts from the
    last reset) and set_epoch(e) when a new epoch starts; keep the sampler in the
    elastic State so that its progress is committed and restored with the model. Every
    rank gets the same number of samples (the last ones repeat a few, like
    DistributedSampler), so ranks stay in step.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed = set()   # dataset indices done this epoch, before the last reshard
        self.num_replicas = 1    # the rank count of the last reshard
        self.done_here = 0       # samples of each rank's shard done since then
        self.indices: List[int] = []
        self.reset()

    def _epoch_order(self) -> List[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def _remaining(self) -> List[int]:
        return [i for i in self._epoch_order() if i not in self.processed]

    @staticmethod
    def _shard(remaining: List[int], replicas: int, rank: int) -> List[int]:
        if not remaining:
            return []
        per_rank = math.ceil(len(remaining) / replicas)
        padded = (remaining * math.ceil(per_rank * replicas / len(remaining)))
        return padded[:per_rank * replicas][rank::replicas]

    def reset(self) -> None:
        """Fold every rank's progress into `processed` (ranks move in step, so each
        has done `done_here` samples of its shard) and reshard the rest over the current
        ranks."""
        if self.done_here:
            remaining = self._remaining()
            for r in range(self.num_replicas):
                self.processed.update(self._shard(remaining, self.num_replicas, r)[:self.done_here])
        self.num_replicas = _rs.size() if _rs.is_initialized() else 1
        rank = _rs.rank() if _rs.is_initialized() else 0
        self.done_here = 0
        self.indices = self._shard(self._remaining(), self.num_replicas, rank)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (a no-op if it is the current one, so calling it at the top
        of the epoch loop after a restore keeps the restored progress)."""
        if epoch == self.epoch:
            return
        self.epoch, self.processed, self.done_here = epoch, set(), 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batches 0..batch_idx of this reshard's iteration are done."""
        self.done_here = min(len(self.indices), (batch_idx + 1) * batch_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def state_dict(self):
        return {"epoch": self.epoch, "processed": sorted(self.processed),
                "num_replicas": self.num_replicas, "done_here": self.done_here,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state) -> None:
        """Take a saved (or rank 0's) progress and reshard it over the current ranks."""
        self.epoch, self.seed, self.shuffle = state["epoch"], state["seed"], state["shuffle"]
        self.processed = set(state["processed"])
        self.num_replicas, self.done_here = state["num_replicas"], state["done_here"]
        self.reset()
