"""What the model decides about a run that shards it or cuts it (dp_shard, tp, pp or cp above 1), checked on a copy
of the model built on the meta device: BatchNorm layers in a dimension that does not build them (the composition
table), blocks for fsdp to shard, cp's attention, a tensor plan and tp dividing the heads, every pipeline stage cut
as each rank will cut its own, the stages composing to the model (no residual added outside a block:
pipeline_checks.py), and a user's tensor plan naming only parts the model holds.

One sequence, called before any run directory or worker exists (runner/cli/preflight_model.py: preflight, under
the user's own torchrun on every rank, and the launcher for a sweep's later jobs) and by every rank's engine before
it builds the model (runner/engine/engine.py), so an engine built without that preflight (a process group of one's
own) refuses the same line rather than training wrong numbers. A run checked once is not checked again in the
processes it starts: the checked runs travel in the environment (RUNNER_MODEL_CHECKED) to the launcher's workers.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

CHECKED_ENV = "RUNNER_MODEL_CHECKED"  # the digests of the runs checked in this process or the one that started it


def check_model_composition(spec: Any, dims: Any, data: Any = None, say: Callable[[str], None] | None = None) -> None:
    """Refuse (SpecError, one line) what the model makes of the run's degrees `dims` (ParallelDims, -1 resolved);
    `say` gets a line for what cannot be checked (a forward the pipeline check cannot trace). `data`: the run's
    (built here when not given). A model whose constructor cannot run on the meta device is built once on the CPU
    and moved there (_model_to_check): every rank will build it whole anyway."""
    if not (spec.parallelism.dp_shard != 1 or dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1 or dims.cp > 1):
        return
    digest = _digest(spec, dims)
    if digest in _checked():
        return
    from runner.engine.parallel import pipeline, shard_blocks, tensor as tensor_parallel
    from runner.engine.parallel.context import check_model as check_context_model
    from runner.engine.parallel.pipeline_checks import check_stages_compose
    from runner.engine.run_data import build_data
    from runner.specs import composition

    par = spec.parallelism
    data = build_data(spec) if data is None else data
    model = _model_to_check(spec, data)
    if model is not None:
        composition.check_model(spec, model)  # its BatchNorm layers, in a dimension that does not build them
        if par.dp_shard != 1:
            shard_blocks(model)  # raises when the model has nothing to shard
        if dims.cp > 1:
            check_context_model(model, spec.model.target)
        tensor_parallel.check(model, par, dims.tp)  # a plan, and tp dividing the heads
        if dims.pp > 1:  # every stage can be cut (a plan, enough blocks), and the stages make the model
            num_stages = dims.pp * pipeline.stages_per_rank(par)
            stages = [pipeline.cut_stage(model, par.pp_plan, spec.model.target, i, num_stages) for i in range(num_stages)]
            inputs = _sample_inputs(data)
            note = check_stages_compose(model, stages, inputs, spec.model.target) if inputs is not None else None
            if note is not None and say is not None:
                say(note)
        # last: it splits the meta model's parameters as a rank's plan will
        tensor_parallel.check_user_plan(model, par, dims.tp, spec.model.target)
    os.environ[CHECKED_ENV] = ",".join(sorted(_checked() | {digest}))


def _model_to_check(spec: Any, data: Any) -> Any:
    """The model on the meta device, where every check runs without memory: built there, or, where its constructor
    cannot run there (it reads a value, an op lacks a meta kernel), built on the CPU and moved there. The run's
    random draws are kept as they were (the engine checks before it builds the run's own model from the same
    seed). None where the CPU build fails too: that failure is the engine build's to report, with the run's context."""
    import random

    import numpy as np
    import torch

    from runner.engine import components
    from runner.engine.parallel.parallelize import build_on_meta
    from runner.specs.run import SpecError

    model, why = build_on_meta(spec, data)
    if model is not None or not why:
        return model
    states = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            model = components.build_model(spec, data)
    except SpecError:
        raise
    except Exception:  # noqa: BLE001 - the engine's build fails the same way, and says so there
        return None
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    return model.to(torch.device("meta")) if isinstance(model, torch.nn.Module) else None


def _sample_inputs(data: Any) -> Any:
    """A batch's model inputs as the loader makes them (its first samples, collated as every batch is); None
    where there is none to take (an empty training split, which the run refuses itself; an iterable dataset)."""
    from runner.engine.loader import Collate
    from runner.tasks.batches import split_batch

    try:
        if len(data.train) == 0:
            return None
    except TypeError:  # an iterable dataset without a length: a sample would be drawn from its stream
        return None
    keyed = bool(getattr(data.train, "takes_sample_seeds", False))
    return split_batch(Collate(data.train, data.collate, keyed).stand_in().stand_in).inputs


def _checked() -> set[str]:
    return set(filter(None, os.environ.get(CHECKED_ENV, "").split(",")))


def _digest(spec: Any, dims: Any) -> str:
    """What the checks read (the model, the data and a k-fold run's fold, the task, the degrees, the device), for
    this run directory: the launcher's workers, and the launcher's check of the run preflight checked, find it."""
    key = repr((os.path.abspath(spec.run_dir), spec.model, spec.dataset, spec.task, spec.parallelism, dims,
                spec.trainer.device, spec.trainer.cross_validation))
    return hashlib.sha256(key.encode()).hexdigest()[:16]
