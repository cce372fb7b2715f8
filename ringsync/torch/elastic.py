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

from ringsync import basics as _rs
from ringsync.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                              run)  # (the module's API)

from . import _sharded_elastic as sharded
from .functions import broadcast_optimizer_state, broadcast_parameters
from .sharded_module import ShardedModule


class TorchState(ObjectState):
    """A model's parameters and buffers, an optimizer's state (a DistributedOptimizer
    or a plain one), and any keyword values, as one elastic State."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        super().__init__(**kwargs)

    def snapshot(self):
        if sharded.holds_shards(self.model, self.optimizer):  # (each rank's part differs)
            return {"sharded": sharded.snapshot(self.model, self.optimizer),
                    "objects": super().snapshot()}
        return {
            "model": _clone(self.model.state_dict()) if self.model is not None else None,
            "optimizer": (copy.deepcopy(self.optimizer.state_dict())
                          if self.optimizer is not None else None),
            "objects": super().snapshot(),
        }

    def load_snapshot(self, snapshot) -> None:
        if self.optimizer is not None:
            self._drop_pending_reductions()
        if "sharded" in snapshot:
            sharded.restore(snapshot["sharded"], self.model, self.optimizer)
        else:
            if self.model is not None:
                self.model.load_state_dict(snapshot["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
        super().load_snapshot(snapshot["objects"])

    def broadcast_state(self, root_rank: int) -> None:
        if self.optimizer is not None:
            self._drop_pending_reductions()
        if sharded.holds_shards(self.model, self.optimizer):
            _broadcast_replicated(self.model, root_rank)  # (the parts are each rank's own)
        else:
            if self.model is not None:
                broadcast_parameters(self.model.state_dict(), root_rank,
                                     prefix="elastic.model")
            if self.optimizer is not None:
                broadcast_optimizer_state(self.optimizer, root_rank)
        super().broadcast_state(root_rank)

    def _drop_pending_reductions(self):
        """Gradient reductions started on the ring that failed will never complete."""
        reset = getattr(self.optimizer, "reset_pending", None)
        if reset is not None:
            reset()


def _broadcast_replicated(model, root_rank):
    """What every rank holds whole beside sharded state: a plain model's parameters and
    buffers (stages 1 and 2), a ShardedModule's buffers."""
    if model is None:
        return
    if isinstance(model, ShardedModule):
        broadcast_parameters(dict(model.module.named_buffers()), root_rank,
                             prefix="elastic.buffers")
    else:
        broadcast_parameters(model.state_dict(), root_rank, prefix="elastic.model")


def _clone(state_dict):
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state_dict.items()}


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ElasticSampler: shards a dataset over the current ranks and, after a
    recovery, reshards what no rank has processed yet of the epoch over the new ranks.

    Keep it in the elastic State (its progress is committed and restored with the model),
    call record_batch(batch_idx, batch_size) after each batch and set_epoch(e) when epoch
    e starts. Every rank gets the same number of samples (the last ones repeat a few, as
    with DistributedSampler), so ranks stay in step.

    Horovod's attributes: epoch, processed_num (samples of this epoch done by all ranks:
    the first processed_num of the epoch's order, since shards are strided), num_replicas,
    rank, remaining_indices (the epoch's order less what is done), num_samples (this
    rank's share), total_size (num_samples * num_replicas), indices (this rank's share),
    processed_indices (what record_indices recorded: Horovod's older way).
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: List[int] = []
        self.reset()

    def _epoch_order(self) -> List[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    @staticmethod
    def _shard(remaining: List[int], replicas: int, rank: int) -> List[int]:
        if not remaining:
            return []
        per_rank = math.ceil(len(remaining) / replicas)
        padded = (remaining * math.ceil(per_rank * replicas / len(remaining)))
        return padded[:per_rank * replicas][rank::replicas]

    def reset(self) -> None:
        """Reshard what is left of the epoch over the current ranks (a recovery, a new
        epoch and load_state_dict call it)."""
        self.num_replicas = _rs.size() if _rs.is_initialized() else 1
        self.rank = _rs.rank() if _rs.is_initialized() else 0
        done = self.processed_indices
        self.remaining_indices = [i for i in self._epoch_order()[self.processed_num:]
                                  if i not in done]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._shard(self.remaining_indices, self.num_replicas, self.rank)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: its own order, nothing processed. (Unlike Horovod's, a
        no-op for the current epoch, so calling it at the top of the epoch loop after a
        restore keeps the restored progress instead of starting the epoch over.)"""
        if epoch == self.epoch:
            return
        self.epoch, self.processed_num, self.processed_indices = epoch, 0, set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One more batch of batch_size samples done on every rank (Horovod's count)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        """These dataset indices are done (Horovod's older API; reset() leaves them out)."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """This rank's dataset indices of batch batch_idx since the last reset."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices), "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state) -> None:
        """Take a saved (or rank 0's) progress, also Horovod's {epoch, processed_num}, and
        reshard it over the current ranks."""
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.processed_indices = set(state.get("processed_indices", ()))
        self.seed, self.shuffle = state.get("seed", self.seed), state.get("shuffle", self.shuffle)
        self.reset()
