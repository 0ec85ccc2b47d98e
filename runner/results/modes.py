"""`mode=eval|predict|export`: what runner does with a trained run besides training it.

Each works on `trainer.resume=<run dir | checkpoint file | MLflow run id>` (runner/results/source.py) and runs the
source run's own spec, with the keys typed on this command line on top (another dataset option evaluates
the same model on that data). Only the model's weights are loaded, into an Engine built from that spec, so
evaluation is the engine's own (Engine.evaluate) and its numbers equal the ones training logged. Each
logs a new MLflow run tagged with the run and checkpoint it came from."""
from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

import yaml

from runner.spec.fields import SpecError, set_dotted
from runner.spec.resume import typed_keys

log = logging.getLogger(__name__)

# how and where this invocation runs and logs: never the source run's
_OWN_KEYS = ("mode", "eval", "predict", "tracking", "parallelism", "run_dir", "overrides")


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
    from runner.results import predict

    return evaluate(spec) if spec.mode == "eval" else predict.run(spec)


def source_spec(spec):
    """The spec this invocation runs: the source run's, with what was typed now on top; and the source's
    checkpoint file and MLflow run id."""
    from runner.results.source import resolve_source
    from runner.spec.run import RunSpec

    path, merged, source_run = resolve_source(spec)
    now, typed = spec.to_dict(), typed_keys(spec.overrides)
    for key in typed:
        if key.endswith("."):  # a group choice (dataset=imagefolder): the whole option, not a mix of two
            group = key[:-1]
            # the loader's keys are the run's, not the option's: the source's batch unless typed now
            kept = {k: merged[group][k] for k in ("batch_size", "num_workers") if group == "dataset" and f"dataset.{k}" not in typed}
            merged[group] = {**now[group], **kept}
        elif key.split(".")[0] not in _OWN_KEYS:
            set_dotted(merged, key, _get(now, key))
    merged.update({k: now[k] for k in _OWN_KEYS})
    merged["trainer"]["resume"] = str(path)
    merged["model"].pop("weights", None)  # the checkpoint's weights replace any starting weights
    return RunSpec.from_yaml(yaml.safe_dump(merged, sort_keys=False)), path, source_run


def load_engine(spec, path: Path, tracker=None):
    """An Engine of spec holding the checkpoint's model weights (nothing else of its training state), and the
    step they were saved at."""
    from runner.engine import checkpoint
    from runner.engine.engine import Engine

    # the checkpoint is loaded here, model only: the engine must not resume the optimizer, schedule or data position
    engine = Engine(spec.replace(trainer=dataclasses.replace(spec.trainer, resume=None)), tracker)
    state = checkpoint.load(path)
    try:
        engine.module.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        raise SpecError(f"trainer.resume: the checkpoint's weights do not fit this model ({str(e).splitlines()[0]})") from None
    engine.model.eval()
    return engine, int(state.get("progress", {}).get("step", 0))


def tracked(spec, source_run: str | None, path: Path, verb: str):
    """A new MLflow run (or none, tracking=none) tagged with the run and checkpoint this one used."""
    from runner.tracking.tracker import build_tracker

    Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(spec.run_dir) / "spec.yaml").write_text(spec.to_yaml())
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.set_tags({f"runner.{verb}_checkpoint": str(path), f"runner.{verb}_run": source_run or "", "runner.mode": spec.mode})
    return tracker


def evaluate(spec):
    from runner.engine.engine import RunResult

    started = time.perf_counter()
    spec, path, source_run = source_spec(spec)
    engine, step = load_engine(spec, path)  # what can be refused is, before this run's records exist
    tracker = tracked(spec, source_run, path, "evaluated")
    try:
        metrics = {}
        for split in spec.eval.splits:
            metrics.update(engine.evaluate(split))
        tracker.log_metrics(metrics, step)
        tracker.finish("FINISHED")
    except BaseException as e:
        tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    values = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()) or "(the splits are empty)"
    print(f"runner: evaluated {path} (step {step})\n  {values}\n  run directory: {spec.run_dir}\n"
          f"  {tracker.describe()}", file=sys.stdout, flush=True)
    seconds = time.perf_counter() - started
    return RunResult(metrics.get(spec.objective.metric, math.nan), {}, {}, metrics, step, seconds)


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


