"""Data and model parallelism inside one worker: the process group, the model wrap (DDP or FSDP2),
gradient-sync control under accumulation, cross-rank reductions, and full state dicts.

Starting the workers is runner/cli/launch.py's job; this module assumes it runs in one of them.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from runner.spec.parallelism import ParallelismSpec
from runner.spec.run import SpecError


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: rank 0 of world 1 when not distributed."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def in_torchrun() -> bool:
    """True inside a worker started by torchrun or torch's elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def init_process_group(device_type: str, timeout_s: float = 600) -> DistEnv:
    """Join the group the elastic agent set up (env://): nccl on CUDA, gloo on CPU."""
    env = DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=timeout, **_store_of_this_attempt(env, timeout))
    return env


def _store_of_this_attempt(env: DistEnv, timeout: datetime.timedelta) -> dict:
    """The agent's store, with keys of this restart round only.

    torch's elastic agent (c10d rendezvous) keeps one TCPStore for all rounds, and env:// adds no
    per-round prefix (torch assumes a fresh store per round). After a restart, a rank could then read a
    dead worker's gloo address or NCCL id left from the previous round and fail with "Connection
    refused", costing every restart the agent had. A prefix per round keeps the rounds apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world, is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"runner/round_{attempt}", store), "rank": env.rank, "world_size": env.world}


def wrap(module: nn.Module, spec: ParallelismSpec, env: DistEnv, device: torch.device,
         param_dtype: torch.dtype | None, find_unused: bool = False) -> nn.Module:
    """DDP replicates the model; FSDP2 shards each block's parameters, then the root's."""
    if spec.name == "single" or not env.distributed:
        return module
    if spec.sync_batchnorm:  # before the wrap, so that DDP/FSDP register the synchronised layers
        from runner.engine import sync_batchnorm

        sync_batchnorm.convert(module, device)
    if spec.name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # gradients are reduced in fp32 whatever the compute dtype, as the correctness rules ask
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # pinned host memory speeds the copies to a GPU; without one there is nothing to pin for
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if spec.cpu_offload else OffloadPolicy()
    fully_shard = functools.partial(fully_shard, reshard_after_forward=spec.reshard_after_forward,
                                    offload_policy=offload)
    blocks = shard_blocks(module)
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] if param_dtype else []
    for norm in norms:
        # BatchNorm's running statistics are fp32 buffers that F.batch_norm will not mix with bf16/fp16
        # weights: norm layers keep fp32 parameters (inputs are cast up; autocast casts down after)
        fully_shard(norm, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    for block in blocks:
        if not any(block is norm for norm in norms):
            fully_shard(block, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    return module


def parameter_device(spec: ParallelismSpec, device: torch.device) -> torch.device:
    """Where the parameters live once wrapped (and so where the optimizer steps): the CPU under fsdp's cpu_offload."""
    return torch.device("cpu") if spec.name == "fsdp" and spec.cpu_offload else device


def shard_blocks(module: nn.Module) -> list[nn.Module]:
    """The units FSDP2 shards one by one: the children of every Sequential/ModuleList that hold
    parameters (an MLP's Linear layers, a ResNet's BasicBlocks), outermost first, none nested.
    A model without any cannot be sharded block by block: a SpecError says so."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for parent in module.modules():
        if id(parent) in inside or not isinstance(parent, (nn.Sequential, nn.ModuleList)):
            continue
        for child in parent.children():
            if any(True for _ in child.parameters()) and not isinstance(child, (nn.Sequential, nn.ModuleList)):
                blocks.append(child)
                inside.update(id(m) for m in child.modules())
    if not blocks:
        raise SpecError(f"parallelism: fsdp found no blocks to shard in {type(module).__name__} (no child module with "
                        "parameters in a Sequential or ModuleList); use parallelism=ddp")
    return blocks


def sync_gradients(model: nn.Module, sync: bool) -> ContextManager:
    """Under accumulation only the last micro-step all-reduces (DDP no_sync; FSDP2 requires-sync flag)."""
    if hasattr(model, "no_sync"):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def all_reduce_sum(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sums across ranks in one collective (evaluation: loss sums, correct counts, sample counts)."""
    if not dist.is_initialized():
        return values
    flat = torch.stack([v.double() for v in values])
    dist.all_reduce(flat)
    return list(flat.unbind())


def all_reduce_max(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Maxima across ranks in one collective (the divergence watch: every rank decides alike)."""
    if not dist.is_initialized():
        return values
    flat = torch.stack([v.double() for v in values])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return list(flat.unbind())


def global_count(local: int | torch.Tensor, device: torch.device) -> torch.Tensor | int:
    """The step's sample (or token) count summed over ranks: the loss is normalised by it, so ranks
    holding unequal shares of a batch still give the global mean (one small all-reduce per step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    # a fill kernel, not a host-to-device copy (which would wait for every queued kernel)
    count = local.double() if isinstance(local, torch.Tensor) else torch.full((), float(local), dtype=torch.float64, device=device)
    dist.all_reduce(count)
    return count


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state as full (unsharded) tensors on the CPU, on every rank.

    Checkpoints hold full state dicts rather than torch.distributed.checkpoint shards: at the sizes
    this runner trains the gather is cheap, and one file loads into single, ddp or fsdp alike, so a run
    can resume on a different number of devices.
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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2 grad norms), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_tensor_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SpecError("trainer.device: 'cuda' was asked for but no CUDA GPU is visible; use trainer.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)
