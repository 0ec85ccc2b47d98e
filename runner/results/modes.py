"""`mode=eval|predict|export`: what runner does with a trained run besides training it.

Each works on `trainer.resume=<run dir | checkpoint file | MLflow run id>` (runner/results/source.py) and runs the
source run's own spec, with the keys typed on this command line on top (another dataset option evaluates
the same model on that data). A run directory means the weights the run tested (`weights.which`,
`weights.average`: runner/engine/run_weights.py). Only weights are loaded, into an Engine built from that
spec, so evaluation is the engine's own (Engine.evaluate) and its numbers equal the ones training logged.
Each logs a new MLflow run tagged with the run and checkpoint it came from."""
from __future__ import annotations

import logging
import math
import sys
import time

from runner.results.source import load_engine, source_spec, tracked
from runner.specs.fields import SpecError

log = logging.getLogger(__name__)


def run(spec):
    """Dispatch a spec whose mode is not train; returns a RunResult (objective: the objective's metric, if evaluated)."""
    if spec.mode == "export":
        try:
            from runner.results import export
        except ImportError:
            raise SpecError("mode: export is not part of this installation (runner/results/export.py is missing); "
                            "choose one of train, eval, predict") from None
        from runner.engine.engine import RunResult

        export.run(spec)  # says where it wrote the export
        return RunResult(float("nan"), {}, {}, {}, 0, 0.0)  # nothing evaluated: no objective
    if spec.parallelism.name != "single":
        raise SpecError(f"parallelism: mode={spec.mode} runs in one process; drop parallelism={spec.parallelism.name}")
    split = [(k, getattr(spec.parallelism, k)) for k in ("tp", "pp", "cp") if getattr(spec.parallelism, k) != 1]
    if split:  # single with a model-parallel degree starts several processes; eval and predict read full weights
        raise SpecError(f"parallelism.{split[0][0]}: mode={spec.mode} runs in one process; drop "
                        f"parallelism.{split[0][0]}={split[0][1]}")
    from runner.results import predict

    return evaluate(spec) if spec.mode == "eval" else predict.run(spec)


def evaluate(spec):
    """The run's weights evaluated as training evaluated them: the raw ones and each average the run kept
    (`<split>/ema/<name>`), so a run directory gives the numbers the run reported for the weights it tested."""
    from runner.engine.engine import RunResult

    started = time.perf_counter()
    spec, source = source_spec(spec)
    engine = load_engine(spec, source, averages=True)  # what can be refused is, before this run's records exist
    path, step = source.path, source.weights.step
    tracker = tracked(spec, source, "evaluated")
    try:
        metrics = {}
        for split in spec.eval.splits:
            metrics.update({**engine.evaluate(split), **engine.averages.evaluate(split)})
        tracker.log_metrics(metrics, step)
        tracker.finish("FINISHED")
    except BaseException as e:
        tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    values = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()) or "(the splits are empty)"
    print(f"runner: evaluated the {source.weights.source} weights of {path}\n  {values}\n  run directory: {spec.run_dir}\n"
          f"  {tracker.describe()}", file=sys.stdout, flush=True)
    seconds = time.perf_counter() - started
    return RunResult(metrics.get(spec.objective.metric, math.nan), {}, {}, metrics, step, seconds)

