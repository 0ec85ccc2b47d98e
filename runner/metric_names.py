"""Metric names a run produces, known from its spec before anything runs (no torch): what a monitor,
a plateau schedule or an objective may watch. The engine checks again once the data is built."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runner.fields import SpecError, did_you_mean

if TYPE_CHECKING:
    from runner.spec import RunSpec


def fraction(spec: RunSpec, split: str) -> float:
    value = spec.dataset.get(f"{split}_fraction", 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


# The built-in tasks' metrics, known without importing them (torch); a user's task is checked once built.
_BUILT_IN = {"runner.tasks.Classification": ("loss", "acc", "top5"), "runner.tasks.LanguageModeling": ("loss", "ppl"),
             "runner.tasks.Regression": ("loss", "mae")}


def task_unit(spec: RunSpec) -> str:
    """What the task's loss averages over."""
    return "tokens" if spec.task.target == "runner.tasks.LanguageModeling" else "samples"


def split_metrics(spec: RunSpec, split: str) -> set[str]:
    """The metrics the task reports for a split (classification may add top5: known once the data is)."""
    return {f"{split}/{name}" for name in _BUILT_IN.get(spec.task.target, ())}


def has_split(spec: RunSpec, split: str) -> bool:
    """Whether the dataset will hold a `split` split, as far as its arguments tell before it is built: a
    builder that carves it takes `<split>_fraction`; one without that key brings its own (official test
    sets, folders). The engine checks again once the data is built."""
    if f"{split}_fraction" in spec.dataset.params:
        return fraction(spec, split) > 0
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
    unit = task_unit(spec)
    names = {"train/loss", "lr", "grad_norm", "epoch", f"throughput/{unit}_per_s", "objective"}
    if spec.precision.name == "fp16":
        names.add("fp16/skipped_steps")
    if spec.trainer.device == "cuda":
        names.add("memory/max_allocated_gib")
    during, at_end = evaluation_metrics(spec)
    return names | during | at_end


def check_metric_names(spec: RunSpec) -> None:
    """A misspelled monitor or objective would silently watch nothing (NaN): refuse it before training."""
    if spec.task.target not in _BUILT_IN:
        return  # a user's task: its metrics are known once it is built (the engine checks then)
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
    split = value.split("/")[0]
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
