"""What the model decides about a run that shards it or cuts it (dp_shard, tp, pp or cp above 1), checked on the
model built on the meta device before any run directory or worker exists: the engine's own sequence of checks
(runner/engine/parallel/model_checks.py), at the degrees the launcher will start.

Called by preflight (runner/cli/preflight.py: a single run, the first job of a sweep, before Hydra makes a
directory) and by the launcher before it starts workers (a sweep's later jobs, k-fold's folds, a reproduced run);
a run checked once in this process is not checked again, here or in the workers it starts. Under the user's own
torchrun every rank checks it here, at torchrun's degrees; every rank's engine runs the same checks as it builds
(a run started otherwise than by this command line). A run with none of those
dimensions imports nothing here (no torch before a single run's own import).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from runner.cli.run_dir import under_torchrun
from runner.specs import composition


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
    from runner.engine.parallel import resolve_dims
    from runner.engine.parallel.model_checks import check_model_composition as check
    from runner.specs.parallelism import nominal_world, world_source

    par = spec.parallelism
    if under_torchrun():  # the user's: its processes make the degrees (check_processes said they do)
        dims = resolve_dims(par, int(os.environ["WORLD_SIZE"]), "torchrun's WORLD_SIZE")
    else:
        dims = resolve_dims(par, nominal_world(par), world_source(par))
    check(spec, dims, say=say or _warn)


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)
