"""K-fold cross-validation (`trainer.cross_validation.folds=K`): one K-fold run made of K ordinary runs.

The K-fold run owns its run directory: spec.yaml, its MLflow run (the parent of the folds' runs), and
`cross_validation.yaml`, the results of the folds that finished. Fold k is an ordinary run in
`<run dir>/fold-<k>` (its own spec.yaml, checkpoints and MLflow child run), started the way this run
would have been (in this process, or torchrun workers for ddp/fsdp). Its spec differs only in
`trainer.cross_validation.fold`, from which the data builder hands it its fold (runner/engine/folds.py).

The value the K-fold run returns (to a `-m` grid or an Optuna study) is the mean of the folds'
objectives; the parent MLflow run logs the mean, the standard deviation (of the K values, ddof=0 as
scikit-learn's cv_results_) and each fold's value at step = fold.

The K-fold run owns the rules that concern it as a whole, so that its folds are K runs of one configuration:
- finders (`tune=lr_find|batch_size`) run once, on the K-fold run (its train split, before fold 0); with
  tune.apply=true every fold trains with the one answer (the K-fold run's spec.yaml records it), without
  it the K-fold run reports and trains no fold;
- resume: `trainer.resume=<run dir>` (or `latest`, which names the K-fold run, never one of its folds)
  skips the folds the record holds, resumes the first unfinished one from its own checkpoints, and goes on;
- extension: a resume with a longer trainer.max_steps/max_epochs extends every fold: each fold the record
  holds at the old length resumes its own checkpoint and trains on to the new one, and the K-fold run's
  results (the record, cv/* on its MLflow run, the mean it returns) are those of the extended folds.
As an Optuna trial, after each fold the mean of the folds so far is reported at step = fold index and the
study's pruner asked: a hopeless trial stops between folds, without training the rest.

It starts each fold through the `run_one` it is given (runner.cli.launch.run: in this process or as
torchrun workers), so that launch, which starts a K-fold run, is not imported back from here.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from runner.engine import folds
from runner.engine.run_data import build_data

from runner.cli import run_lock
from runner.files import atomic_write
from runner.engine.engine import RunResult
from runner.specs import resume
from runner.specs.run import RunSpec, SpecError
from runner.specs.trial import TrialSpec
from runner.tracking.tracker import RUN_FILE, build_tracker
from runner.engine.parallel import in_torchrun
from runner.search.trial import TrialReporter, is_pruned, open_trial, parent_run_id, pruned

log = logging.getLogger(__name__)

RECORD = "cross_validation.yaml"  # the finished folds' results: what a resume skips


def fold_dir(run_dir: Path, fold: int) -> Path:
    return run_dir / f"fold-{fold}"


def fold_spec(spec: RunSpec, fold: int, parent_run: str | None) -> RunSpec:
    """Fold `fold`'s run: the K-fold run's spec in its own directory, resumed in place when it already began.
    It reports to no Optuna trial itself (its steps restart at 0 each fold): the K-fold run does."""
    where = fold_dir(Path(spec.run_dir), fold)
    began = run_lock.holds_run(where)
    cv = dataclasses.replace(spec.trainer.cross_validation, fold=fold, parent_run=parent_run)
    trainer = dataclasses.replace(spec.trainer, cross_validation=cv, resume=str(where) if began else None)
    overrides = tuple(o for o in spec.overrides if not o.lstrip("+~").startswith(("trainer.resume=", "trial.")))
    spec = spec.replace(run_dir=str(where), trainer=trainer, trial=TrialSpec(),
                        overrides=(*overrides, f"trainer.cross_validation.fold={fold}"))
    return spec.replace(overrides=(*spec.overrides, *_changed_since(spec, where))) if began else spec


def _changed_since(spec: RunSpec, where: Path) -> tuple[str, ...]:
    """What the K-fold run's resume changes in a fold that began (a longer run, another device...), as the
    overrides the fold's own resume applies: the keys a resume may change whose value differs from the
    fold's spec.yaml. (The K-fold run's resume checked the rest against its own spec.)"""
    saved = RunSpec.from_yaml((where / "spec.yaml").read_text()).flat() if (where / "spec.yaml").is_file() else {}
    return tuple(f"{key}={value}" for key, value in spec.flat().items()
                 if key.startswith(resume.MAY_CHANGE) and not key.startswith(("trainer.resume", "trial."))
                 and key in saved and saved[key] != value)


def trained_to(spec: RunSpec) -> str:
    """How long a fold trains, as the record keeps it: a fold recorded at another length is extended."""
    t = spec.trainer
    return f"trainer.max_steps={t.max_steps}" if t.max_steps else f"trainer.max_epochs={t.max_epochs}"


def read_record(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = run_dir / RECORD
    return {int(k): v for k, v in (yaml.safe_load(path.read_text()) or {}).get("folds", {}).items()} \
        if path.is_file() else {}


def run_folds(spec: RunSpec, run_dir: Path, run_one: Callable[[RunSpec], RunResult]) -> RunResult:
    """Train the folds not yet done (or done at another length), one after another, each by `run_one`;
    the mean objective over all K."""
    cv, metric = spec.trainer.cross_validation, spec.objective.metric
    if in_torchrun():  # each fold's run would form its own process group among ranks already in one
        raise SpecError(f"trainer.cross_validation.folds: {cv.folds} folds cannot run inside torchrun; start "
                        "`python -m runner parallelism=ddp parallelism.nproc_per_node=N ...` without torchrun: it "
                        "starts each fold's workers itself")
    # a finder with several processes: refused while the spec was built (runner/specs/composition.py)
    size, val_sizes, stratified = folds.plan(build_data(spec), cv.folds, cv.seed)  # refusals come now
    done = read_record(run_dir)
    (run_dir / "spec.yaml").write_text(spec.to_yaml())
    tracker = build_tracker(spec, parent_run_id=parent_run_id(spec))
    if spec.tune.name:  # once, for every fold: K folds tuned apart would be K configurations, not one
        from runner import tune
        from runner.engine.parallel import DistEnv

        spec, tracker = tune.run_finder(spec, DistEnv(), tracker)  # spec.yaml then holds what the folds train
        if spec is None:  # tune.apply=false: found and reported, no fold to train
            return tune.NOTHING_TRAINED
    length = trained_to(spec)
    stale = [k for k in sorted(done) if done[k].get("trained_to", length) != length]
    tracker.start(spec)
    kind = "stratified by class" if stratified else "not stratified"
    finished = [k for k in sorted(done) if k not in stale]
    log.info("%d-fold cross-validation over the %d samples of train+val (%s, fold seed %d)%s", cv.folds, size, kind,
             cv.seed, f"; folds {', '.join(map(str, finished))} done already" if finished else "")
    if stale:
        log.info("folds %s trained to %s: extending folds %s from their checkpoints to %s", _listed(stale),
                 done[stale[0]].get("trained_to"), _listed(stale), length)
    started = time.perf_counter()
    try:  # from here on, whatever fails ends the K-fold run's MLflow run FAILED (or KILLED), never RUNNING
        tracker.set_tags({"cv.folds": str(cv.folds), "cv.stratified": str(stratified).lower()})
        _log_unlogged_folds(tracker, run_dir, metric, {k: done[k] for k in finished})
        reporter = open_trial(spec)
        if reporter is not None:
            reporter.record_run(tracker.run_id)  # the K-fold run is the trial's run, not a fold's
            reporter.per_epoch = False  # its resource is folds: it reports at step = fold index
        for k in range(cv.folds):
            if k not in done or k in stale:
                result = run_one(fold_spec(spec, k, tracker.run_id))
                done[k] = {"objective": float(result.objective), "final": dict(result.final), "steps": result.steps,
                           "seconds": round(result.seconds, 3), "train": size - val_sizes[k], "val": val_sizes[k],
                           "trained_to": length}
                _write_record(run_dir, cv, metric, done)
                _log_fold(tracker, run_dir, metric, k, done[k])
            verdict = _report(reporter, metric, k, done)
            if verdict:
                tracker.set_tags({"pruned": "true", "runner.outcome": "pruned",
                                  "mlflow.runName": f"{tracker.run_name} (pruned)"})
                tracker.finish("FINISHED")
                raise pruned(verdict)
        values = [done[k]["objective"] for k in range(cv.folds)]
        mean, std = statistics.fmean(values), statistics.pstdev(values)
        final = {name: statistics.fmean(done[k]["final"][name] for k in range(cv.folds))
                 for name in done[0]["final"] if all(name in done[k]["final"] for k in range(cv.folds))}
        _log_results(tracker, {f"cv/{metric}_mean": mean, f"cv/{metric}_std": std, "objective": mean,
                               **{f"cv/{name}_mean": v for name, v in final.items()}}, cv.folds - 1)
        if reporter is not None and reporter.trial is not None:
            reporter.trial.set_user_attr(f"cv/{metric}_std", std)  # beside the mean in the sweep's table
        tracker.finish("FINISHED")
    except KeyboardInterrupt:
        tracker.finish("KILLED")
        raise
    except BaseException as e:
        if not is_pruned(e):
            tracker.set_tags({"runner.outcome": "failed"})
            tracker.finish("FAILED")
        raise
    log.info(table(spec, done, mean, std, stratified) + f"\n  {tracker.describe()}")
    return RunResult(mean, {f"cv/{metric}_mean": mean, f"cv/{metric}_std": std}, {}, final,
                     sum(done[k]["steps"] for k in range(cv.folds)), time.perf_counter() - started)


def _write_record(run_dir: Path, cv: Any, metric: str, done: dict[int, dict[str, Any]]) -> None:
    record = {"folds_total": cv.folds, "seed": cv.seed, "metric": metric, "folds": {k: done[k] for k in sorted(done)}}
    atomic_write(run_dir / RECORD, yaml.safe_dump(record, sort_keys=False))  # a kill mid-write leaves the last whole record


def _log_fold(tracker: Any, run_dir: Path, metric: str, k: int, fold: dict[str, Any]) -> None:
    """On the parent: fold k's objective and final metrics at step k. On fold k's own run: cv/fold."""
    _log_results(tracker, {f"cv/{metric}": fold["objective"], **{f"cv/{n}": v for n, v in fold["final"].items()}}, k)
    client = getattr(tracker, "client", None)  # None with tracking=none
    child_file = fold_dir(run_dir, k) / RUN_FILE
    if client is not None and child_file.is_file():
        from mlflow.entities import Metric, RunTag

        client.log_batch(child_file.read_text().strip(), metrics=[Metric("cv/fold", k, int(time.time() * 1000), 0)],
                         tags=[RunTag("cv.fold", str(k))])


def _log_unlogged_folds(tracker: Any, run_dir: Path, metric: str, done: dict[int, dict[str, Any]]) -> None:
    """The recorded folds whose results the K-fold run's MLflow run lacks, logged now: a kill between a fold's
    record and its logging would otherwise lose them for good (the resume skips a recorded fold)."""
    client = getattr(tracker, "client", None)  # None with tracking=none
    if client is None or not done:
        return
    logged = {m.step for m in client.get_metric_history(tracker.run_id, f"cv/{metric}")}
    for k in sorted(set(done) - logged):
        _log_fold(tracker, run_dir, metric, k, done[k])


def _log_results(tracker: Any, metrics: dict[str, float], step: int) -> None:
    """The K-fold run's results, on its MLflow run, now. Not through the tracker's log_metrics: a resumed
    tracker drops what its run holds at a step already, and an extended fold's result replaces the one
    logged before (MLflow shows a metric's newest value at a step)."""
    client = getattr(tracker, "client", None)  # None with tracking=none
    if client is None:
        return
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(tracker.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def _listed(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers))


def _report(reporter: TrialReporter | None, metric: str, k: int, done: dict[int, dict[str, Any]]) -> str | None:
    """The running mean of folds 0..k to the trial at step k; the pruner's verdict (None: go on)."""
    if reporter is None:
        return None
    reporter.report({metric: statistics.fmean(done[i]["objective"] for i in range(k + 1))}, k)
    return reporter.verdict()


def table(spec: RunSpec, done: dict[int, dict[str, Any]], mean: float, std: float, stratified: bool) -> str:
    """The console's account of the folds: sizes, objective, test metric, steps, seconds; the mean +- std."""
    metric = spec.objective.metric
    test = "test/" + metric.split("/", 1)[1] if metric.startswith("val/") else None
    if test is not None and not all(test in done[k]["final"] for k in done):
        test = None
    width = max(len(metric), 8)
    head = f"  {'fold':>4}  {'train':>6}  {'val':>6}  {metric:>{width}}" + (f"  {test:>{width}}" if test else "")
    rows = [head + f"  {'steps':>6}  {'seconds':>7}"]
    for k in sorted(done):
        f = done[k]
        value = f"{f['objective']:.4f}" if math.isfinite(f["objective"]) else "nan"
        rows.append(f"  {k:>4}  {f['train']:>6}  {f['val']:>6}  {value:>{width}}"
                    + (f"  {f['final'][test]:>{width}.4f}" if test else "") + f"  {f['steps']:>6}  {f['seconds']:>7.1f}")
    test_mean = f"  {statistics.fmean(done[k]['final'][test] for k in done):>{width}.4f}" if test else ""
    rows.append(f"  {'mean':>4}  {'':>6}  {'':>6}  {mean:>{width}.4f}{test_mean}   (std {std:.4f})")
    kind = "stratified" if stratified else "plain"
    return (f"runner: {len(done)}-fold cross-validation ({kind} folds, fold seed {spec.trainer.cross_validation.seed}), "
            f"{metric} {mean:.4f} +- {std:.4f}\n" + "\n".join(rows) + f"\n  run directory: {spec.run_dir}")
