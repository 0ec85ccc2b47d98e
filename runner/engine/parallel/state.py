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
    model_state, optim_state = get_state_dict(module, optimizer, options=options)
    if _nested_placements(module):  # torch gathers these in the wrong row order: gathered again here
        for name, param in module.named_parameters(remove_duplicate=False):
            if _is_nested(param):
                value = gathered(param).cpu()  # every rank joins; only those holding the full dicts keep it
                if name in model_state:
                    model_state[name] = value
                for key, moment in optimizer.state.get(param, {}).items():
                    if _is_nested(moment):
                        value = gathered(moment).cpu()
                        if name in optim_state.get("state", {}):
                            optim_state["state"][name][key] = value
    return model_state, optim_state


def full_model_state(module: nn.Module) -> dict:
    """The model's state as full tensors on the CPU (a collective under fsdp: every rank calls it)."""
    pipeline = getattr(module, "_runner_pipeline", None)
    if pipeline is not None:  # this rank's stages: every stage's part merged (parallel/pipeline.py)
        return pipeline.full_model_state()
    # imported here: torch.distributed.checkpoint costs 0.7 s of start-up before the first training line
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, param in module.named_parameters(remove_duplicate=False):
        if _is_nested(param):  # see full_state
            value = gathered(param).cpu()
            if name in state:
                state[name] = value
    return state


def load_model_state(module: nn.Module, model_state: dict) -> None:
    """The whole model's full state into `module`, wrapped or one rank's pipeline stages."""
    pipeline = getattr(module, "_runner_pipeline", None)
    if pipeline is not None:
        pipeline.load_model_state(model_state)
        return
    load_full_model_state(module, model_state)


def load_full_state(module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=True)
    if _nested_placements(module):
        model_state, optim_state = placed_state(module, model_state), _placed_optim_state(module, optim_state)
        options = StateDictOptions(full_state_dict=False)
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
    return _grad_norm(grads, norm_type, _plain(grads))


def _plain(grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is a plain tensor (one process, ddp): no DTensor to group or to make full."""
    return all(type(g) is torch.Tensor for g in grads)


def _grad_norm(grads: list[torch.Tensor], norm_type: float, plain: bool) -> torch.Tensor:
    if plain:  # torch's own, as torch.nn.utils.clip_grad_norm_ computes it: no per-gradient Python work here
        return torch.nn.utils.get_total_norm(grads, norm_type)
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
    plain = _plain(grads)
    total = _grad_norm(grads, 2.0, plain)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if grads:
        local = grads if plain else [local_tensor_of(g) for g in grads]
        torch._foreach_mul_(local, scale.to(local[0].device))
    return total


def clip_grad_value(params: list[torch.Tensor], clip_value: float) -> None:
    """torch's clip_grad_value_ for gradients that may mix DTensors and plain tensors: each rank clamps its part."""
    for p in params:
        local_tensor_of(p.grad).clamp_(-clip_value, clip_value)


def load_full_model_state(module: nn.Module, model_state: dict) -> None:
    """Full (unsharded) model weights into a wrapped model, any mesh (best weights, averages)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if _nested_placements(module):
        set_model_state_dict(module, placed_state(module, model_state), options=StateDictOptions(full_state_dict=False))
    else:
        set_model_state_dict(module, model_state, options=StateDictOptions(full_state_dict=True))


def _is_nested(t: torch.Tensor) -> bool:
    return hasattr(t, "placements") and len(t.placements) > 1 and _nested_placements_of(t.placements)


def gathered(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), FSDP2 shards over a strided tensor-parallel split included:
    FSDP's shards gathered into the tp rank's part first, then the tp parts (placed_like's inverse)."""
    if not _is_nested(t):
        return full_tensor(t)
    from torch.distributed.tensor import DTensor, Shard

    mesh, placements = t.device_mesh, t.placements
    tp_mesh, dp_mesh = mesh[mesh.mesh_dim_names[-1]], mesh[mesh.mesh_dim_names[-2]]
    if placements[-2].is_replicate():  # FSDP2's replicate (ddp x tp): each rank holds its whole tp part
        tp_local = t.to_local()
    else:
        dim = placements[-2].dim
        tp_shape = list(t.shape)
        tp_shape[dim] //= tp_mesh.size()
        tp_stride = torch.empty(tp_shape, device="meta").stride()
        tp_local = DTensor.from_local(t.to_local(), dp_mesh, [Shard(dim)], run_check=False,
                                      shape=torch.Size(tp_shape), stride=tp_stride).full_tensor()
    return DTensor.from_local(tp_local, tp_mesh, placements[-1:], run_check=False, shape=t.shape,
                              stride=t.stride()).full_tensor()


def _nested_placements(module: nn.Module) -> bool:
    """Whether a parameter is FSDP2-sharded over a tensor-parallel split that is itself strided (the fused qkv
    of runner/engine/parallel/tensor.py): torch's distribute_tensor cannot lay a full tensor out so."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, DTensor) and len(p.placements) > 1 and isinstance(p.placements[-1], _StridedShard)
               for p in module.parameters())


def placed_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as the DTensor `like` (this rank's part, no communication: every rank holds `full`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    full = full.to(like.device)
    mesh, placements = like.device_mesh, like.placements
    if len(placements) == 1 or not _nested_placements_of(placements):
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    # FSDP2 over a strided tensor-parallel split (the mesh's last dimension): the tp rank's part first, then
    # FSDP's chunk of it along its shard dimension (torch.chunk, as fully_shard cuts)
    tp_mesh = mesh[mesh.mesh_dim_names[-1]]
    tp_local = distribute_tensor(full, tp_mesh, placements[-1:], src_data_rank=None).to_local()
    shard = placements[-2]
    if shard.is_replicate():  # FSDP2's replicate (ddp x tp)
        local = tp_local
    else:
        dp_size, dp_index = mesh.size(mesh.ndim - 2), mesh.get_local_rank(mesh.ndim - 2)
        chunks = torch.chunk(tp_local, dp_size, dim=shard.dim)
        local = chunks[dp_index] if dp_index < len(chunks) else tp_local.narrow(shard.dim, 0, 0)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=like.shape, stride=like.stride())


def _nested_placements_of(placements) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placements[-1], _StridedShard)


def placed_state(module: nn.Module, model_state: dict) -> dict:
    """A full model state dict with each parameter's entry laid out as the parameter (see placed_like)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {k: placed_like(v, params[k]) if k in params else v for k, v in model_state.items()}


def _placed_optim_state(module: nn.Module, optim_state: dict) -> dict:
    params = dict(module.named_parameters(remove_duplicate=False))
    state = {}
    for name, entry in optim_state.get("state", {}).items():
        like = params.get(name)
        state[name] = {k: placed_like(v, like) if like is not None and isinstance(v, torch.Tensor)
                       and v.shape == like.shape else v for k, v in entry.items()}
    return {**optim_state, "state": state}
