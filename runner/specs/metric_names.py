"""The checks and the values that need the task, run after the spec is built (RunSpec.validate needs no
task). Names, directions and the unit are the task's declarations (runner/tasks), read from its class
without building it (no torch):

- the metric names a run produces, known from its spec before anything runs: what a monitor, a plateau
  schedule or an objective may watch (a misspelled one is refused);
- the directions left null: objective.direction, early stopping's and plateau's mode (a typed objective
  direction that contradicts the declaration is refused).

`with_task_declarations` is that step; the CLI, preflight, the PBT sweep and `components.resolved_spec`
apply it to every spec they build. The engine checks the names again once the data is built.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from runner import tasks
from runner.specs.fields import SpecError, did_you_mean
from runner.specs.objective import ObjectiveSpec

if TYPE_CHECKING:
    from runner.specs.run import RunSpec


def task_class(target: str) -> type[tasks.Task]:
    """The task class `target` names (task._target_), refused in one line unless it is a runner task."""
    cls = tasks.task_class(target)
    if not (isinstance(cls, type) and issubclass(cls, tasks.Task)):  # its metrics and directions would be unknown
        raise SpecError(f"task._target_: {target} is not a task class; name a subclass of runner.tasks.Task "
                        "(its loss, metrics and their directions), e.g. runner.tasks.Classification")
    return cls


def unit(spec: RunSpec) -> str:
    """What the task's loss is averaged over: samples or tokens."""
    return task_class(spec.task.target).unit


def direction(spec: RunSpec, metric: str) -> str:
    """maximize or minimize, as the task declares `metric` (`<split>/<name>`)."""
    return tasks.direction(task_class(spec.task.target), metric)


def with_task_declarations(spec: RunSpec) -> RunSpec:
    """The spec after the checks that need its task: every metric it watches is one the run evaluates, and
    the directions left null are the task's (the objective's, early stopping's and plateau's). A task that
    cannot be imported is left as it is: building it says why, in one line naming task._target_."""
    try:
        task_class(spec.task.target)
    except SpecError:
        raise
    except (ImportError, AttributeError, ValueError):
        return spec
    check_metric_names(spec)
    spec = with_declared_modes(spec)
    return dataclasses.replace(spec, objective=resolved_objective(spec.objective, spec.task.target))


def resolved_objective(objective: ObjectiveSpec, task_target: str) -> ObjectiveSpec:
    """The objective with its direction: the one the task declares for its metric. A direction given (typed,
    or from a preset) that contradicts the declaration is refused: ranking by it would keep the worst
    weights. The sweep hook resolves a sweep's objective here too, from its composed config."""
    cls = task_class(task_target)
    try:
        declared = tasks.direction(cls, objective.metric)
    except ValueError:
        raise SpecError(f"objective.metric: {objective.metric!r} is not a metric {cls.__name__} declares; choose one "
                        f"of {', '.join(f'val/{name}' for name in sorted(cls.metrics))}") from None
    if objective.direction is not None and objective.direction != declared:
        raise SpecError(f"objective.direction: {objective.direction} contradicts the task: {cls.__name__} declares "
                        f"{objective.metric} {declared}; allowed: {declared}, or null (the task's)")
    return dataclasses.replace(objective, direction=declared)


def with_declared_modes(spec: RunSpec) -> RunSpec:
    """The spec with early stopping's and plateau's unset `mode` filled in from the direction the task
    declares for the metric they watch (a user's val/r2 or val/bleu rises, a loss falls)."""
    es, scheduler = spec.trainer.early_stopping, spec.scheduler
    if es.mode is None and es.monitor is not None:
        es = dataclasses.replace(es, mode=_mode(spec, es.monitor))
    if "mode" in scheduler.params and scheduler.params["mode"] is None:  # no monitor: the schedule says so itself
        mode = _mode(spec, scheduler.monitor) if scheduler.monitor is not None else "min"
        scheduler = scheduler.with_params({**scheduler.params, "mode": mode})
    return dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, early_stopping=es), scheduler=scheduler)


def _mode(spec: RunSpec, metric: str) -> str:
    try:
        return "max" if direction(spec, metric) == "maximize" else "min"
    except ValueError:  # not the task's metric: check_metric_names says so in its own words
        return "min"


def split_metrics(spec: RunSpec, split: str) -> set[str]:
    """The metrics the task declares for a split (an instance may report fewer: top5 needs > 5 classes),
    and those of the averaged weights (val/ema/acc)."""
    names = {f"{split}/{name}" for name in task_class(spec.task.target).metrics}
    return names | averaged(spec, names)


_AVERAGING_KEYS = {"ema": "trainer.ema.decay (e.g. 0.999)", "swa": "trainer.swa.start_epoch"}


def averaged(spec: RunSpec, names: set[str]) -> set[str]:
    """`val/acc` -> `val/ema/acc`, `val/swa/acc`: the same metrics of the weights each averaging that is on
    keeps (runner/addons/averaging.py), with the same direction (`tasks.direction` reads the last part)."""
    kinds = [kind for kind, on in (("ema", spec.trainer.ema.decay is not None),
                                   ("swa", spec.trainer.swa.start_epoch is not None)) if on]
    return {f"{split}/{kind}/{name}" for split, _, name in (n.partition("/") for n in names) for kind in kinds}


def has_split(spec: RunSpec, split: str) -> bool:
    """Whether the dataset will hold a `split` split, as far as its arguments tell before it is built: a
    builder that carves it takes `<split>_fraction`; one without that key brings its own (official test
    sets, folders). The engine checks again once the data is built."""
    if f"{split}_fraction" in spec.dataset.params:
        return spec.dataset.fraction(split) > 0
    return True


def evaluation_metrics(spec: RunSpec) -> tuple[set[str], set[str]]:
    """(metrics evaluated during training, metrics evaluated only at the end): val/* and test/*."""
    trainer = spec.trainer
    during: set[str] = set()
    if has_split(spec, "val") and (trainer.eval_every_epoch or trainer.eval_every_n_steps > 0):
        during = split_metrics(spec, "val")
    at_end = split_metrics(spec, "test") if has_split(spec, "test") else set()
    return during, at_end


def produced_metrics(spec: RunSpec) -> set[str]:
    """Every metric name the run will log (without importing torch). memory/max_allocated_gib is
    included only for trainer.device=cuda: with device=auto it depends on the machine."""
    names = {"train/loss", "lr", "grad_norm", "epoch", f"throughput/{unit(spec)}_per_s", "throughput/tflops", "objective"}
    if spec.trainer.peak_tflops is not None:  # else only on a GPU the table knows (runner/engine/flops.py)
        names.add("throughput/mfu")
    if spec.trainer.compile is not False:
        names.add("compile/seconds")
    if spec.precision.name == "fp16":
        names.add("fp16/skipped_steps")
    if spec.trainer.device == "cuda":
        names.add("memory/max_allocated_gib")
    during, at_end = evaluation_metrics(spec)
    return names | during | at_end


def check_metric_names(spec: RunSpec) -> None:
    """A misspelled monitor or objective would silently watch nothing (NaN): refuse it before training."""
    during, at_end = evaluation_metrics(spec)
    if spec.trainer.early_stopping.monitor is not None:
        _check_metric("trainer.early_stopping.monitor", spec.trainer.early_stopping.monitor, during, at_end, spec, "=null")
    if spec.scheduler.monitor is not None:
        _check_metric("scheduler.monitor", spec.scheduler.monitor, during, at_end, spec, None)
    # The objective is checked against what the splits hold, not against the evaluation schedule:
    # turning evaluation off (benchmarks, quick runs) is deliberate and leaves the objective NaN.
    splits = at_end | (split_metrics(spec, "val") if has_split(spec, "val") else set())
    _check_metric("objective.metric", spec.objective.metric, splits, set(), spec, None)


def _check_metric(key: str, value: str, allowed: set[str], end_only: set[str], spec: RunSpec, off: str | None) -> None:
    if value in allowed:
        return
    choose = f"choose one of {', '.join(sorted(allowed))}" if allowed else ""
    if value in end_only:
        raise SpecError(f"{key}: {value!r} is evaluated only at the end of the run; {choose or _missing(spec, 'val', key, off)}")
    split, _, name = value.partition("/")
    kind, _, base = name.partition("/")
    declared = split_metrics(spec, split) if split in ("val", "test") else set()
    if kind in _AVERAGING_KEYS and value not in declared and f"{split}/{base}" in declared:  # that averaging is off
        raise SpecError(f"{key}: {value!r} is a metric of the {kind.upper()} weights, which this run does not keep; set "
                        f"{_AVERAGING_KEYS[kind]}, or watch {split}/{base}")
    if value in split_metrics(spec, "val") | split_metrics(spec, "test") or not allowed:
        fix = _missing(spec, split if split == "test" else "val", key, off) + (f", or {choose}" if choose else "")
        raise SpecError(f"{key}: {value!r} is never evaluated in this run: {fix}")
    raise SpecError(f"{key}: {value!r} is not a metric this run evaluates; {did_you_mean(value, allowed)}{choose}")


def _missing(spec: RunSpec, split: str, key: str, off: str | None) -> str:
    """Why the run never evaluates on `split` (val: during training), and how to change that."""
    if split == "test":
        why = "dataset.test_fraction=0 leaves no test split; set dataset.test_fraction > 0"
    elif not has_split(spec, "val"):
        why = "dataset.val_fraction=0 leaves no validation split; set dataset.val_fraction > 0"
    else:
        why = "trainer.eval_every_epoch=false and trainer.eval_every_n_steps=0 never evaluate; set one of them"
    return why + (f", or {key}{off}" if off else "")


def check_produced(spec: RunSpec, task: tasks.Task, split_sizes: dict[str, int]) -> None:
    """Once the data is built: a watched metric that this run never produces stops it here (it would watch
    nothing), e.g. val/top5 with 5 classes or less, or val/* with an empty split."""
    produced = {name for split in ("val", "test") if split_sizes[split] for name in task.metric_names(split)}
    produced |= averaged(spec, produced)
    during = {name for name in produced if name.startswith("val/")}
    watched = [("objective.metric", spec.objective.metric, produced),
               ("trainer.early_stopping.monitor", spec.trainer.early_stopping.monitor, during)]
    if spec.scheduler.monitor is not None:
        watched.append(("scheduler.monitor", spec.scheduler.monitor, during))
    for key, metric, allowed in watched:
        if metric is not None and metric not in allowed:
            raise SpecError(f"{key}: {metric!r} is never produced by this run (dataset splits: "
                            f"{', '.join(f'{k} {v}' for k, v in split_sizes.items())}); "
                            f"choose one of {', '.join(sorted(allowed)) or '(none: no evaluation split)'}")
