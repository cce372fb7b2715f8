"""SyncBatchNorm: batch normalisation whose batch statistics cover every rank's batch.

A drop-in for torch.nn.BatchNorm1d/2d/3d (same parameters, buffers and state_dict keys).
The per-rank sums are combined with the differentiable allreduce, so autograd yields the
exact gradient of the global normalisation without a hand-written backward.
"""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ringsync.ops import ReduceOp
from ringsync.process_sets import global_process_set

from . import mpi_ops


class SyncBatchNorm(_BatchNorm):
    """A torch.nn.modules.batchnorm._BatchNorm (as torch.nn.SyncBatchNorm is, so that user
    code that checks isinstance(m, _BatchNorm) treats it as a batch norm); its own
    forward pass combines the ranks' statistics."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None,
                 process_set=global_process_set):
        """process_set: the ranks whose batches are normalised together (a ProcessSet or
        Communicator; default: the job's)."""
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, x):
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm expects (N, {self.num_features}, ...), got "
                             f"{tuple(x.shape)}")

    def forward(self, x):
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        mean, var, count = self._global_moments(x)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean, var, count)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = (x - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
        return y

    def _global_moments(self, x):
        """Mean and biased variance over every rank's batch, and the element count."""
        dims = [0] + list(range(2, x.dim()))
        local_count = torch.tensor([x.numel() / self.num_features], dtype=x.dtype)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), local_count.to(x.device)])
        total = mpi_ops.allreduce(stats, op=ReduceOp.SUM, process_set=self.process_set)
        c = self.num_features
        count = total[2 * c]
        mean = total[:c] / count
        var = total[c: 2 * c] / count - mean * mean
        return mean, var, count

    @torch.no_grad()
    def _update_running_stats(self, mean, var, count):
        self.num_batches_tracked += 1
        factor = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        unbiased = var * (count / torch.clamp(count - 1, min=1))
        self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module):
        """A copy of module's structure with every BatchNorm1d/2d/3d replaced by
        SyncBatchNorm (parameters and running statistics carried over)."""
        batch_norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
        if isinstance(module, batch_norms):
            sync = cls(module.num_features, module.eps, module.momentum, module.affine,
                       module.track_running_stats)
            sync.load_state_dict(module.state_dict())
            sync.train(module.training)
            return sync
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child))
        return module
