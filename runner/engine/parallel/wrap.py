"""The model's wrap, chosen by the parallel dimensions that split anything: a table of parallelize
functions, not a branch per strategy name. dp_replicate alone replicates (DDP); dp_shard shards (FSDP2
fully_shard per block, then the root); both shard on the 2-D mesh (HSDP: sharded within a dp_shard
group, replicated across the dp_replicate groups). A model-parallel dimension's plan is applied before
(tensor.py: the tensor-parallel plan, then activation checkpointing), and its dimension picks the row here.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from runner.engine.parallel.ring import ring_reduce_scatter, use_rings
from runner.engine.parallel.mesh import DATA_PARALLEL, DistEnv
from runner.specs.parallelism import ParallelismSpec
from runner.specs.run import SpecError


@dataclass(frozen=True)
class Wrapping:
    """What a parallelize function needs besides the module."""

    spec: ParallelismSpec
    env: DistEnv
    device: torch.device
    param_dtype: torch.dtype | None
    find_unused: bool


def replicate(module: nn.Module, how: Wrapping) -> nn.Module:
    """DDP: a full replica per rank, gradients all-reduced over dp_replicate."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [how.device.index] if how.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=how.find_unused,
                                   process_group=how.env.mesh["dp_replicate"].get_group())


def shard(module: nn.Module, how: Wrapping) -> nn.Module:
    """FSDP2 on the data-parallel sub-mesh: 1-D (dp_shard) shards; 2-D (dp_replicate, dp_shard) is HSDP."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    spec, param_dtype = how.spec, how.param_dtype
    mesh = how.env.mesh[data_parallel_dims(how.env)]
    # gradients are reduced in fp32 whatever the compute dtype, as the correctness rules ask
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # pinned host memory speeds the copies to a GPU; without one there is nothing to pin for
    offload = CPUOffloadPolicy(pin_memory=how.device.type == "cuda") if spec.cpu_offload else OffloadPolicy()
    fully_shard = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=spec.reshard_after_forward,
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
    # the model's other units (gpt: its position embedding and final norm), so that the root holds the tied weight
    # alone and the rings gather it into its own memory: on a CPU's rings, one data-parallel dimension
    rings_alone = how.device.type == "cpu" and mesh.ndim == 1 and how.env.dims.tp == 1
    units = [m for m in getattr(module, "fsdp_units", list)() if not any(m is n for n in norms)] if rings_alone else []
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    # gloo's collectives copy through whole-size temporaries
    use_rings([*norms, *blocks, *units, module], how.device, {id(module): lone_parameter(module)} if units else None)
    free_root_early(module, blocks[0])
    if rings_alone:
        reduce_whole_gradient_in_place(module, mesh, how)
    return module


def param_group(unit: nn.Module) -> object | None:
    """FSDP2's parameter group of a fully_shard-ed unit (its FSDPParams, `reduce_grads`). FSDP2 keeps it private: None
    where it is not as expected, and what uses it leaves the unit to FSDP2 as before."""
    group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
    return group if hasattr(group, "fsdp_params") and hasattr(group, "reduce_grads") else None


def lone_parameter(unit: nn.Module) -> object | None:
    """FSDP2's FSDPParam of a unit holding one parameter sharded by rows; None otherwise."""
    params = getattr(param_group(unit), "fsdp_params", ())
    if len(params) != 1 or getattr(getattr(params[0], "fsdp_placement", None), "dim", None) != 0:
        return None
    return params[0]


def reduce_whole_gradient_in_place(module: nn.Module, mesh, how: Wrapping) -> None:
    """The root unit's one parameter whose whole gradient the model makes in one accumulation (gpt's tied weight,
    `fsdp_gradient_made_whole()`), reduce-scattered in its own memory as soon as it is made (a ring, on a CPU): FSDP2
    would copy it into a reduce-scatter input of its own first, and at the backward's end each rank held both (GPT-2:
    2 x 147 MiB, each rank's peak under fsdp). The sum is the one FSDP2 makes (the same ring over the same layout,
    averaged), set as the sharded parameter's gradient (added to one there under accumulation), and the unsharded
    gradient is dropped before FSDP2's reduce, which then leaves the parameter alone. Called where the rings shard
    alone (a CPU, one data-parallel dimension); only where FSDP2's input would be that gradient's own layout (fp32,
    not offloaded, rows that divide among the ranks), and only in a backward where FSDP2 reduces (the last
    micro-step) and the model made the gradient whole (not a compiled forward pass: `tied_gradient_whole`)."""
    made_whole = getattr(module, "fsdp_gradient_made_whole", None)
    weight = made_whole() if callable(made_whole) else None
    if weight is None or how.param_dtype is not None or how.spec.cpu_offload or weight.shape[0] % mesh.size():
        return
    group = param_group(module)
    fsdp_param = next((p for p in getattr(group, "fsdp_params", ()) if p.sharded_param is weight), None)
    if fsdp_param is None:
        return
    process_group = mesh.get_group()

    def reduce(unsharded: torch.Tensor) -> None:
        grad = unsharded.grad
        if not (group.reduce_grads and getattr(module, "tied_gradient_whole", False)) or grad is None \
                or not grad.is_contiguous():
            return
        unsharded.grad = None
        shard = torch.empty(fsdp_param.sharded_size, dtype=grad.dtype, device=grad.device)
        ring_reduce_scatter(shard, grad, process_group, average=True)  # its partial sums overwrite the gradient
        del grad
        sharded = fsdp_param.sharded_param
        if sharded.grad is None:
            sharded.grad = fsdp_param.to_sharded_dtensor(shard)
        else:
            sharded.grad._local_tensor.add_(shard)

    def arm(_: nn.Module, args: tuple) -> None:
        # FSDP2 makes the unsharded parameter at its first gather (its own pre-forward hook runs before this one) and
        # keeps that object: the hook is registered once
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None and not getattr(unsharded, "_runner_reduced_in_place", False):
            unsharded.register_post_accumulate_grad_hook(reduce)
            unsharded._runner_reduced_in_place = True

    module.register_forward_pre_hook(arm)


def free_root_early(module: nn.Module, first_block: nn.Module) -> None:
    """FSDP2 keeps the root unit's parameters gathered for the whole backward (the root's forward inputs, token ids,
    need no gradient, so nothing marks its backward's end before the backward's). A model naming the module whose
    backward is the last to read them (`fsdp_root_read_until()`: gpt's final norm) has them freed right after that
    backward: gpt's tied weight then no longer sits gathered beside its whole gradient at the backward's end, where
    each rank peaked. Their gradients still land on the unsharded parameters (kept, their memory freed) and are
    reduced at the backward's end as before. The first block's backward no longer prefetches the root (FSDP2 gathers
    the unit that ran before a block ahead of that block's backward): nothing gathers it again in this backward."""
    read_until = getattr(module, "fsdp_root_read_until", None)
    last = read_until() if callable(read_until) else None
    if last is None:
        return

    def free(grad: torch.Tensor) -> None:
        module.reshard()

    def arm(_: nn.Module, args: tuple, output: object) -> None:
        # a hook on the gradient of its input: called once that module's backward has run
        if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(free)

    last.register_forward_hook(arm)
    first_block.set_modules_to_backward_prefetch([])


def replicate_split(module: nn.Module, how: Wrapping) -> nn.Module:
    """DDP over a tensor-parallel model: FSDP2's replicate on dp_replicate (torchtitan's choice), which
    all-reduces DTensor gradients as DDP's buckets cannot; fp32 reduction as in `shard`."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_with_fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = how.param_dtype
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    return replicate_with_fsdp(module, mesh=how.env.mesh["dp_replicate"], mp_policy=policy)


# the data-parallel dimensions of degree > 1, and tp when the model is split by a tensor-parallel plan (applied
# before: runner/engine/parallel/tensor.py) -> how the model is wrapped for them; FSDP2 shards a tensor-parallel
# DTensor on the data-parallel sub-mesh (FSDP x TP: a 2-D mesh; HSDP x TP: 3-D)
DATA_PARALLEL_WRAPS: dict[tuple[str, ...], Callable[[nn.Module, Wrapping], nn.Module]] = {
    ("dp_replicate",): replicate,                     # ddp
    ("dp_shard",): shard,                             # fsdp
    ("dp_replicate", "dp_shard"): shard,              # hsdp
    ("dp_replicate", "tp"): replicate_split,          # ddp x tp
    ("dp_shard", "tp"): shard,                        # fsdp x tp
    ("dp_replicate", "dp_shard", "tp"): shard,        # hsdp x tp
}


def data_parallel_dims(env: DistEnv) -> tuple[str, ...]:
    return tuple(n for n in DATA_PARALLEL if getattr(env.dims, n) > 1)


def wrap_key(env: DistEnv) -> tuple[str, ...]:
    """The row of DATA_PARALLEL_WRAPS for `env`."""
    return data_parallel_dims(env) + (("tp",) if env.dims.tp > 1 else ())


def wrap(module: nn.Module, spec: ParallelismSpec, env: DistEnv, device: torch.device,
         param_dtype: torch.dtype | None, find_unused: bool = False) -> nn.Module:
    """The module wrapped for the dimensions of `env` (placed: see mesh.place); itself in one process."""
    dims = data_parallel_dims(env)
    if not dims or env.mesh is None:
        return module
    if spec.sync_batchnorm:  # before the wrap, so that DDP/FSDP register the synchronised layers
        from runner.engine import sync_batchnorm

        sync_batchnorm.convert(module, device)
    return DATA_PARALLEL_WRAPS[wrap_key(env)](module, Wrapping(spec, env, device, param_dtype, find_unused))


def parameter_device(spec: ParallelismSpec, env: DistEnv, device: torch.device) -> torch.device:
    """Where the parameters live once wrapped (and so where the optimizer steps): the CPU under a shard's cpu_offload."""
    return torch.device("cpu") if spec.cpu_offload and "dp_shard" in data_parallel_dims(env) else device


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
