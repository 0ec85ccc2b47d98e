"""Finders that run before training (`tune=lr_find`, `tune=batch_size`): each drives an engine built from
the run's spec, prints what it found with the override to use, and records it in the run's MLflow run
(curve or throughputs as metrics, the suggestion as a tag, the plot and the report as artifacts).

With tune.apply=true the run then trains a fresh engine built from the spec with the value applied and
the finder turned off: spec.yaml and the MLflow params are what was trained (a re-run of spec.yaml trains
the same), the tags say where the value came from. Without it the run ends after the report.

The answer is recorded in the run directory (tune.yaml) as soon as the finder ends, before training starts.
A run stopped before that point and resumed runs the finder again; one stopped after it (or a finished
tune.apply=false run, resumed) reports and uses the recorded answer without searching again.
"""
from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner.engine import parallel
from runner.engine.engine import Engine, RunResult
from runner.engine.parallel import DistEnv
from runner.specs.fields import set_dotted
from runner.specs.run import RunSpec
from runner.specs.tune import TuneSpec
from runner.tracking.tracker import NullTracker, Tracker
from runner.tune import batch_size, lr_find
from runner.tune.probing import free_memory

log = logging.getLogger(__name__)

NOTHING_TRAINED = RunResult(math.nan, {}, {}, {}, 0, 0.0)
FINDING_FILE = "tune.yaml"  # the finder's answer, in the run directory: what a resume uses


@dataclass
class Finding:
    """What a finder found, as the run records it."""

    applied: RunSpec                       # the spec with the found value, the finder off
    lines: list[str]                       # the report
    tags: dict[str, str]
    curve: list[dict[str, float]] = field(default_factory=list)  # metrics, one dict per point
    metrics: dict[str, float] = field(default_factory=dict)
    plot: Path | None = None
    changes: dict[str, Any] = field(default_factory=dict)  # the found values by dotted key: what `applied` changed
    said_live: int = 0  # the report's first lines, which the search said on the console as it went (not twice)


def run_finder(spec: RunSpec, env: DistEnv, tracker: Tracker) -> tuple[RunSpec | None, Tracker]:
    """Runs the spec's finder and reports; returns the spec to train (None: tune.apply=false, nothing to
    train) and the tracker, which records the finding as soon as its run starts."""
    # rank 0 decides whether the answer is recorded already: a late rank must not find the file rank 0 writes now
    finding = parallel.broadcast_object(read_finding(spec) if env.is_main else None)
    recorded = finding is not None
    if finding is None:
        engine = Engine(spec, NullTracker(), env)
        device = engine.device
        finding = find(engine, spec.tune)
        del engine  # its model and optimizer state, before the run's own engine is built
        free_memory(device)
        finding = parallel.broadcast_object(finding)  # one answer on every rank
        if env.is_main:
            write_finding(spec, finding)
    recording = RecordingTracker(tracker, finding)
    if env.is_main:
        print("\n".join(finding.lines if recorded else finding.lines[finding.said_live:]), file=sys.stdout, flush=True)
        if recorded:
            log.info("tune: the finding recorded in %s (the finder had finished before the run stopped); not searched "
                     "again", Path(spec.run_dir) / FINDING_FILE)
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
                       points, {"tune/suggested_lr": found.lr}, plot, {"optimizer.lr": found.lr})
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
                   points, metrics, changes={"dataset.batch_size": applied.dataset.batch_size,
                                             "accumulation.steps": applied.accumulation.steps},
                   said_live=1)  # each candidate's samples/s, logged as it was timed


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


def write_finding(spec: RunSpec, finding: Finding) -> None:
    """The finding in the run directory, written whole or not at all (a kill mid-write leaves none)."""
    path = Path(spec.run_dir) / FINDING_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({
        "tune": finding.tags["tune"], "suggestion": finding.tags["tune.suggestion"], "changes": finding.changes,
        "lines": finding.lines, "tags": finding.tags, "metrics": finding.metrics, "curve": finding.curve,
        "plot": str(finding.plot) if finding.plot is not None else None}, sort_keys=False))
    tmp.replace(path)


def read_finding(spec: RunSpec) -> Finding | None:
    """The finding recorded in the spec's run directory by this finder, applied to `spec` (None: none recorded)."""
    path = Path(spec.run_dir) / FINDING_FILE
    saved = yaml.safe_load(path.read_text()) if path.is_file() else None
    if not saved or saved.get("tune") != spec.tune.name:
        return None
    plot = Path(saved["plot"]) if saved.get("plot") and Path(saved["plot"]).is_file() else None
    return Finding(applied(spec, saved["changes"]), list(saved["lines"]), dict(saved["tags"]), list(saved["curve"]),
                   dict(saved["metrics"]), plot, dict(saved["changes"]))


def applied(spec: RunSpec, changes: dict[str, Any]) -> RunSpec:
    """`spec` with a finding's values, the finder off: what a run with tune.apply=true trains."""
    tree = spec.to_dict()
    for key, value in changes.items():
        set_dotted(tree, key, value)
    return _off(RunSpec.from_yaml(yaml.safe_dump(tree)))


def _tags(tune: TuneSpec, suggestion: str, before: str) -> dict[str, str]:
    return {"tune": str(tune.name), "tune.suggestion": suggestion, "tune.before": before,
            "tune.applied": str(tune.apply).lower()}


def _off(spec: RunSpec) -> RunSpec:
    """The spec as trained: the finder off, every value checked as any spec's."""
    return RunSpec.from_yaml(spec.replace(tune=TuneSpec()).to_yaml())
