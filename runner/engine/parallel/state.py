"""Full (unsharded) state dicts of a wrapped model and its optimizer, and the local values of DTensors."""
from __future__ import annotations

import torch
from torch import nn


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state as full (unsharded) tensors on the CPU, on every rank.

    Checkpoints hold full state dicts rather than torch.distributed.checkpoint shards: at the sizes
    this runner trains the gather is cheap, and one file loads into single, ddp, fsdp or hsdp alike, so
    a run can resume on a different number of devices.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(module, optimizer, options=options)


def full_model_state(module: nn.Module) -> dict:
    """The model's state as full tensors on the CPU (a collective under fsdp: every rank calls it)."""
    # imported here: torch.distributed.checkpoint costs 0.7 s of start-up before the first training line
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=True)
    if optim_state.get("state"):
        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
        return
    # An optimizer that keeps no per-parameter state (SGD without momentum): torch's loader takes the device
    # from a state tensor, finds none and refuses ("Expected device to be set"). The groups' settings (lr,
    # weight decay, ...) are all there is to load; runner builds the groups in one order every time.
    set_model_state_dict(module, model_state, options=options)
    saved = optim_state["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this run's "
                         f"{len(optimizer.param_groups)}")
    for group, state in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in state.items() if k != "params"})


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2 grad norms), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total norm of `grads` over every dimension of the mesh, a plain tensor: DTensor gradients (FSDP2
    shards, tensor-parallel splits, replicated norms) and plain ones (a tensor-parallel model's unsplit layers)
    may mix, which torch's get_total_norm refuses; each placement's group is normed by torch and made full."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    if len(groups) <= 1:
        return full_tensor(torch.nn.utils.get_total_norm(grads, norm_type))
    norms = [full_tensor(torch.nn.utils.get_total_norm(group, norm_type)) for group in groups.values()]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for gradients that may mix DTensors and plain tensors (see grad_norm): the total
    norm before clipping; every gradient scaled in place, each rank its own part of a DTensor."""
    grads = [p.grad for p in params]
    total = grad_norm(grads)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_([local_tensor_of(g) for g in grads], scale.to(local_tensor_of(grads[0]).device))
    return total


def clip_grad_value(params: list[torch.Tensor], clip_value: float) -> None:
    """torch's clip_grad_value_ for gradients that may mix DTensors and plain tensors: each rank clamps its part."""
    for p in params:
        local_tensor_of(p.grad).clamp_(-clip_value, clip_value)
