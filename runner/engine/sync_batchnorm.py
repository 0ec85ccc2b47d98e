"""`parallelism.sync_batchnorm`: BatchNorm statistics over the global batch of all ranks.

On a GPU this is torch.nn.SyncBatchNorm. torch refuses SyncBatchNorm on CPU tensors (and DDP refuses
it in a CPU model), so on the CPU (gloo) each BatchNorm layer keeps its class and gets a forward that
computes the same statistics from two differentiable all-reduces (the sum, then the squared
deviations from the global mean); the backward pass sums their gradients over ranks, as
SyncBatchNorm's does.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce


def convert(module: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm of `module` synchronised across ranks (in place where it is not the root itself)."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, _Synced):
            # DDP refuses torch's SyncBatchNorm on the CPU: the class stays the layer's own, with this forward
            m.__class__ = _synced_class(type(m))
    return module


@functools.cache
def _synced_class(cls: type) -> type:
    return type(f"Synced{cls.__name__}", (_Synced, cls), {})


class _Synced:
    """A BatchNorm layer whose training statistics are those of all ranks' batches together."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized():
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        local_count = input.new_tensor([input.numel() // input.size(1)])
        first = all_reduce(torch.cat([input.sum(dims), local_count]))
        count = first[-1]
        mean = first[:-1] / count
        centered = input - mean.view(shape)
        var = all_reduce((centered * centered).sum(dims)) / count
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
                # like torch's: the running variance is the unbiased one
                unbiased = var.detach() * count / (count - 1).clamp(min=1)
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return out
