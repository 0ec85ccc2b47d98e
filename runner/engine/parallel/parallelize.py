"""The model from its component to the one the step loop trains, in one readable order (torchtitan's parallelize_fn).

build_model: where the run shards the model (dp_shard, tp or pp > 1; parallelism.meta_init) it is built on the meta
device, which allocates nothing, its frozen parameters frozen, and its values written by a seed checkpoint
(parallel/seed.py) that no rank holds whole; otherwise, and for a model whose constructor cannot run on the meta
device, every rank builds the whole model as one process does.

parallelize: the pipeline cut (this rank's stages), the tensor plan (then the stages' boundaries under pp x tp),
activation checkpointing, the data-parallel wrap (each stage sharded instead under pp x fsdp), this rank's shards
materialised and loaded from the seed, compile.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from runner.engine import activation_checkpointing, compiling, finetune, fit_checks, rng
from runner.engine.parallel import pipeline as pipelining, seed, tensor as tensor_parallel
from runner.engine.parallel.wrap import parameter_device, wrap
from runner.engine.parallel.mesh import DistEnv
from runner.specs.run import RunSpec, SpecError

log = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """The model as built: whole on this rank's device, or on the meta device with where its values come from."""

    module: nn.Module
    on_meta: bool = False
    seed: Path | None = None  # on_meta: the seed checkpoint this rank's shards load; None where a resume fills them


@dataclass
class Parallelized:
    """What parallelize gives the engine."""

    model: nn.Module   # what the step loop calls: the wrapper (compiled), or under pp every stage (a ModuleList)
    module: nn.Module  # this rank's model, bare: the whole model, or under pp its stages' part under the whole model's names
    pipeline: pipelining.Pipeline | None
    compiled: bool     # trainer.compile took: a ragged batch runs the model uncompiled


def meta_init(spec: RunSpec, env: DistEnv) -> bool:
    """Whether the run builds its model on the meta device: where it shards the model (fsdp, tp, pp; not whole
    replicas, single or ddp) and parallelism.meta_init is auto or true."""
    dims = env.dims
    return spec.parallelism.meta_init is not False and (dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1)



def build_model(spec: RunSpec, data: Any, env: DistEnv, device: torch.device, resuming: bool) -> BuiltModel:
    """The run's model on this rank: on the meta device with its seed checkpoint written where meta_init says so
    (the RNG left as one process's build leaves it), else whole on `device`."""
    say = log.info if env.is_main else (lambda *_: None)
    if meta_init(spec, env):
        before = rng.rng_state()
        module, why = build_on_meta(spec, data)
        rng.set_rng_state(before)  # a constructor on meta may still draw (Python's random, numpy's)
        if module is not None:
            finetune.freeze_for_run(spec, module, say)
            fit_checks.check_model(spec, module)
            # a resumed run's checkpoint fills every value a state dict holds: the seed only for what it does not
            if resuming and not seed.non_persistent_buffers(module):
                return BuiltModel(module, on_meta=True)
            where = seed.write(spec, data, env, before)
            for line in seed.said(where):
                say("%s", line)
            if not resuming:
                rng.set_rng_state(seed.rng_after(where))
            return BuiltModel(module, on_meta=True, seed=where)
        if spec.parallelism.meta_init is True:
            raise SpecError(f"parallelism.meta_init: true, but {spec.model.target} cannot be built on the meta device "
                            f"({why}); use parallelism.meta_init=auto (every rank then builds the whole model) or false")
        say("parallelism.meta_init: %s cannot be built on the meta device (%s): every rank builds the whole model",
            spec.model.target, why)
    return BuiltModel(finetune.whole_model(spec, data, lambda line: say("%s", line)).to(device))


def build_on_meta(spec: RunSpec, data: Any) -> tuple[nn.Module | None, str]:
    """The model built under the meta device (here, and by the checks before any worker starts:
    runner/cli/preflight_model.py), or None and why it cannot be: its constructor raised there, or left
    a parameter or buffer off it (a tensor made from data, say)."""
    from runner.engine import components

    try:
        with torch.device("meta"):
            module = components.build_model(spec, data)
    except SpecError as e:
        # the component's own complaint about its arguments is the same on any device; a RuntimeError (what the
        # meta device refuses: reading a value, an op without a meta kernel) is made one line by the builder too
        cause = e.__context__
        if not isinstance(cause, RuntimeError):
            raise
        return None, _first_line(cause)
    except Exception as e:  # whatever the constructor does that the meta device cannot
        return None, _first_line(e)
    if not isinstance(module, nn.Module):
        return fit_checks.check_model(spec, module), ""  # refused there in one line
    off = next(((name, t) for name, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_meta), None)
    if off is not None:
        return None, f"{off[0]} was made on {off[1].device.type}"
    return module, ""


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"



def parallelize(built: BuiltModel, spec: RunSpec, env: DistEnv, device: torch.device, param_dtype: torch.dtype | None,
                pipeline_loss: Callable[[Any, torch.Tensor], torch.Tensor]) -> Parallelized:
    """`built` (whole, or on the meta device) made this rank's trainable model, in the order below. pipeline_loss:
    (output, labels) -> the task's loss summed over the labels' units, for the pipeline's last stage."""
    par, module, pipe = spec.parallelism, built.module, None
    if env.dims.pp > 1:  # this rank's stages; `module` is then this rank's part of the model (whole-model names)
        pipelining.check_composition(spec, env.dims)
        pipe = pipelining.Pipeline(module, par, env, device, spec.dataset.batch_size, spec.model.target, pipeline_loss)
        module = pipe.module
    tensor_parallel.apply(module, par, env, spec.model.target)  # tp: after the cut, before checkpointing and the data-parallel wrap
    if pipe is not None:  # pp x tp: the stages compute with the split parameters, whole between stages
        pipe.after_tensor_plan(par, env)
    # after the FLOP count (MFU counts the model's FLOPs, not the recomputation), before any wrap
    activation_checkpointing.apply(module, spec.trainer.activation_checkpointing)
    if pipe is None:
        # parameters unfrozen mid-run must still be reduced across ranks
        model = wrap(module, par, env, device, param_dtype, find_unused=spec.model.unfreeze_after_epochs is not None)
    else:  # the schedule calls the stages, not a wrapper: pp x fsdp shards each stage on dp_shard
        pipe.shard_stages(par, env, device, param_dtype)
        model = module
    if built.on_meta:  # every shard in place: only now does this rank allocate its own
        materialise(pipe.stage_modules if pipe is not None else [module], parameter_device(par, env, device), device)
        if pipe is not None:
            pipe.materialised()
        if built.seed is not None:
            seed.load(module, built.seed)
            seed.remove(built.seed, env)
    model = compiling.compile_model(model, spec.trainer.compile, device)
    compiled = hasattr(model, "_orig_mod")  # torch.compile's wrapper
    if pipe is not None:  # train()/eval() reach every stage, a plan's copies included
        model = nn.ModuleList(pipe.stage_modules)
    return Parallelized(model, module, pipe, compiled)


def materialise(modules: list[nn.Module], param_device: torch.device, buffer_device: torch.device) -> None:
    """Every parameter and buffer of `modules` (built on the meta device, then cut, split and sharded) given
    uninitialised memory of its local size: this rank's shards only. FSDP2 takes its shards' new storage in at
    its lazy initialisation (reset_sharded_param). Tied parameters stay one object (the data is swapped in place).
    Under fsdp's cpu_offload the parameters live on the CPU and the buffers on the device, as FSDP2 keeps them."""
    for module in modules:
        module.to_empty(device=param_device)
        if buffer_device != param_device:
            for sub in module.modules():
                for name, buffer in sub._buffers.items():
                    if buffer is not None:
                        sub._buffers[name] = buffer.to(buffer_device)


def fit_optimizer(optimizer: torch.optim.Optimizer, parts: Parallelized) -> None:
    """What the parallel layout asks of the optimizer once built: a group mixing tensor-parallel DTensors with plain
    tensors steps per tensor (tensor.fit_optimizer); under pp a parameter every stage holds has its state split by
    rows between the stages (pipeline.split_tied_state)."""
    tensor_parallel.fit_optimizer(optimizer)
    if parts.pipeline is not None:
        parts.pipeline.split_tied_state(optimizer)
