"""Reductions and broadcasts across ranks, a no-op in one process.

Sums of what the ranks read (samples, tokens, evaluation counts) run over the data-parallel group: the
ranks of one model replica read the same samples. Maxima, gathers, broadcasts and barriers run over
every process.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_data_parallel_group: Any = None  # None: the default group; set once per process by mesh.place()


def use_data_parallel_group(group: Any) -> None:
    global _data_parallel_group
    _data_parallel_group = group


def all_reduce_sum(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sums across the data-parallel replicas in one collective (evaluation: loss sums, correct counts,
    sample counts)."""
    if not dist.is_initialized():
        return values
    flat = torch.stack([v.double() for v in values])
    dist.all_reduce(flat, group=_data_parallel_group)
    return list(flat.unbind())


def all_reduce_max(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Maxima across ranks in one collective (the divergence watch: every rank decides alike)."""
    if not dist.is_initialized():
        return values
    flat = torch.stack([v.double() for v in values])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return list(flat.unbind())


def global_count(local: int | torch.Tensor, device: torch.device) -> torch.Tensor | int:
    """The step's sample (or token) count summed over the data-parallel replicas: the loss is normalised
    by it, so replicas holding unequal shares of a batch still give the global mean (one small all-reduce
    per step)."""
    if not dist.is_initialized() or dist.get_world_size(_data_parallel_group) == 1:
        return local
    # a fill kernel, not a host-to-device copy (which would wait for every queued kernel)
    count = local.double() if isinstance(local, torch.Tensor) else torch.full((), float(local), dtype=torch.float64, device=device)
    dist.all_reduce(count, group=_data_parallel_group)
    return count


def gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's object on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
