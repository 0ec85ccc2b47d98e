"""What the model decides about a run that shards it or cuts it (dp_shard, tp, pp or cp above 1), checked on the
model built on the meta device before any run directory or worker exists: BatchNorm layers in a dimension that
does not build them (the composition table), blocks for fsdp to shard, cp's attention, a tensor plan and tp
dividing the heads, every pipeline stage cut as each worker will cut its own, the stages composing to the
model (no residual added outside a block), and a user's tensor plan naming only parts the model holds.

One sequence of the engine's own check functions, called by preflight (runner/cli/preflight.py: a single run,
the first job of a sweep, before Hydra makes a directory) and by the launcher before it starts workers (a
sweep's later jobs, k-fold's folds, a reproduced run); a spec checked once in this process is not built again.
A run with none of those dimensions imports nothing here (no torch before a single run's own import).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from runner.specs import composition

_checked: set[str] = set()  # the parts of the specs this process has checked (see _key)


def needs_the_model(spec: Any) -> bool:
    """Whether the run shards or cuts the model, so that its layers decide what is refused (no torch needed)."""
    par = spec.parallelism
    dims = composition.degrees(par)
    # dp_shard -1 (fsdp's preset) takes every process: a model with nothing to shard is refused whatever their number
    return par.dp_shard != 1 or any(dims[d] > 1 for d in ("tp", "pp", "cp"))


def check_model_composition(spec: Any, say: Callable[[str], None] | None = None) -> None:
    """Refuse (SpecError, one line) what the model makes of the run's degrees; `say` gets a line for what cannot
    be checked (a forward the pipeline check cannot trace). The model is built on the meta device by the engine's
    own builder; one that cannot be built there is not checked here (the engine's build still cuts, plans and
    shards it with the same functions, which refuse it there, inside the workers)."""
    if not needs_the_model(spec):
        return
    key = _key(spec)
    if key in _checked:
        return
    from runner.engine.parallel import pipeline, resolve_dims, shard_blocks, tensor as tensor_parallel
    from runner.engine.parallel.context import check_model as check_context_model
    from runner.engine.parallel.parallelize import build_on_meta
    from runner.engine.parallel.pipeline_checks import check_stages_compose
    from runner.engine.run_data import build_data
    from runner.specs.parallelism import nominal_world, world_source

    par = spec.parallelism
    dims = resolve_dims(par, nominal_world(par), world_source(par))
    data = build_data(spec)
    model, _ = build_on_meta(spec, data)
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
            if note is not None:
                (say or _warn)(note)
        # last: it splits the meta model's parameters as a worker's plan will
        tensor_parallel.check_user_plan(model, par, dims.tp, spec.model.target)
    _checked.add(key)


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


def _key(spec: Any) -> str:
    """What the checks read (the model, the data and a k-fold run's fold, the task, the degrees, the device), for
    this run directory: the launcher's check of the run preflight checked finds it."""
    return repr((os.path.abspath(spec.run_dir), spec.model, spec.dataset, spec.task, spec.parallelism,
                 spec.trainer.device, spec.trainer.cross_validation))


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)
