"""Finders that run before training (`tune=lr_find`, `tune=batch_size`): each drives an engine built from
the run's spec, prints what it found with the override to use, and records it in the run's MLflow run
(curve or throughputs as metrics, the suggestion as a tag, the plot and the report as artifacts).

With tune.apply=true the run then trains a fresh engine built from the spec with the value applied and
the finder turned off: spec.yaml and the MLflow params are what was trained (a re-run of spec.yaml trains
the same), the tags say where the value came from. Without it the run ends after the report.
"""
from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runner.engine import parallel
from runner.engine.engine import Engine, RunResult
from runner.engine.parallel import DistEnv
from runner.spec.run import RunSpec
from runner.spec.tune import TuneSpec
from runner.tracking.tracker import NullTracker, Tracker
from runner.tune import batch_size, lr_find
from runner.tune.probing import free_memory

log = logging.getLogger(__name__)

NOTHING_TRAINED = RunResult(math.nan, {}, {}, {}, 0, 0.0)


@dataclass
class Finding:
    """What a finder found, as the run records it."""

    applied: RunSpec                       # the spec with the found value, the finder off
    lines: list[str]                       # the report
    tags: dict[str, str]
    curve: list[dict[str, float]] = field(default_factory=list)  # metrics, one dict per point
    metrics: dict[str, float] = field(default_factory=dict)
    plot: Path | None = None


def run_finder(spec: RunSpec, env: DistEnv, tracker: Tracker) -> tuple[RunSpec | None, Tracker]:
    """Runs the spec's finder and reports; returns the spec to train (None: tune.apply=false, nothing to
    train) and the tracker, which records the finding as soon as its run starts."""
    engine = Engine(spec, NullTracker(), env)
    device = engine.device
    finding = find(engine, spec.tune)
    del engine  # its model and optimizer state, before the run's own engine is built
    free_memory(device)
    finding = parallel.broadcast_object(finding)  # one answer on every rank
    recording = RecordingTracker(tracker, finding)
    if env.is_main:
        print("\n".join(finding.lines), file=sys.stdout, flush=True)
    if not spec.tune.apply:
        recording.start(spec)
        recording.finish("FINISHED")
        if env.is_main:
            print(f"  run directory: {spec.run_dir}\n  {tracker.describe()}", file=sys.stdout, flush=True)
        return None, recording
    if env.is_main:
        (Path(spec.run_dir) / "spec.yaml").write_text(finding.applied.to_yaml())
        log.info("tune.apply=true: training with %s", finding.tags["tune.suggestion"])
    return finding.applied, recording


def find(engine: Engine, tune: TuneSpec) -> Finding:
    """The engine's spec's finder, run on it; the engine's trainable state is as before afterwards."""
    spec = engine.spec
    if tune.name == "lr_find":
        curve = lr_find.find_lr(engine, tune)
        found = lr_find.suggest(curve)
        applied = spec.replace(optimizer=spec.optimizer.with_params({**spec.optimizer.params, "lr": found.lr}))
        lines = lr_find.describe(spec, curve, found)
        plot = lr_find.plot(curve, found, Path(spec.run_dir) / "lr_find.png") if engine.env.is_main else None
        if plot is not None:
            lines.append(f"  plot: {plot}")
        points = [{"tune/lr": lr, "tune/loss": loss, "tune/smoothed_loss": smooth}
                  for lr, loss, smooth in zip(curve.lrs, curve.losses, curve.smoothed)]
        return Finding(_off(applied), lines, _tags(tune, f"optimizer.lr={found.lr:g}", f"optimizer.lr={spec.optimizer.lr:g}"),
                       points, {"tune/suggested_lr": found.lr}, plot)
    search = batch_size.find_batch_size(engine, tune)
    applied, answer = batch_size.answer(spec, search, tune, engine.env.dp_degree)
    lines = batch_size.describe(search, tune, engine.device, engine.env.dp_degree) + answer
    suggestion = answer[-1].split("suggested: ", 1)[1].split("   ")[0]
    points = [{"tune/batch_size": b, "tune/samples_per_s": search.throughput[b]} for b in sorted(search.throughput)]
    metrics = {"tune/suggested_batch_size": applied.dataset.batch_size,
               "tune/knee_batch_size": batch_size.knee(search.throughput, tune.knee_tolerance),
               "tune/largest_fit_batch_size": search.largest_fit}
    return Finding(_off(applied), lines, _tags(tune, suggestion, f"dataset.batch_size={spec.dataset.batch_size} "
                                                                  f"accumulation.steps={spec.accumulation.steps}"),
                   points, metrics)


class RecordingTracker:
    """The run's tracker, recording the finding right after its run starts (a failure to record ends the
    run FAILED, never RUNNING); the engine that trains starts it as it would any tracker."""

    def __init__(self, tracker: Tracker, finding: Finding) -> None:
        self.inner, self.finding = tracker, finding

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None:
        self.inner.start(spec, resume_run_id)
        try:
            for step, point in enumerate(self.finding.curve):
                self.inner.log_metrics(point, step)
            self.inner.log_metrics(self.finding.metrics, 0)
            self.inner.set_tags(self.finding.tags)
            self.inner.log_text("\n".join(self.finding.lines) + "\n", f"{self.finding.tags['tune']}.txt")
            if self.finding.plot is not None:
                self.inner.log_artifact(self.finding.plot)
            self.inner.flush()
        except BaseException:
            self.inner.finish("FAILED")
            raise

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _tags(tune: TuneSpec, suggestion: str, before: str) -> dict[str, str]:
    return {"tune": str(tune.name), "tune.suggestion": suggestion, "tune.before": before,
            "tune.applied": str(tune.apply).lower()}


def _off(spec: RunSpec) -> RunSpec:
    """The spec as trained: the finder off, every value checked as any spec's."""
    return RunSpec.from_yaml(spec.replace(tune=TuneSpec()).to_yaml())
