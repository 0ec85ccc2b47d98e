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
    pipeline = getattr(module, "_runner_pipeline", None)
    if pipeline is not None:  # this rank's stages: every stage's part merged (parallel/pipeline.py)
        return pipeline.full_model_state()
    # imported here: torch.distributed.checkpoint costs 0.7 s of start-up before the first training line
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_model_state(module: nn.Module, model_state: dict) -> None:
    """The whole model's full state into `module`, wrapped or one rank's pipeline stages."""
    pipeline = getattr(module, "_runner_pipeline", None)
    if pipeline is not None:
        pipeline.load_model_state(model_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, model_state, options=StateDictOptions(full_state_dict=True))


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
