"""Tasks: what is specific to the problem, in one place. The loss, the metrics with their names and
directions, and the unit the gradient is averaged over (samples, or tokens that are not padding).
The engine stays task-agnostic: it asks a task for a micro-batch's count and loss *sum*, and
normalises by the count of the whole optimizer step on all ranks, so accumulation and ddp/fsdp stay
exact in the task's unit.

The protocol a task implements (subclass `Task`; `runner.tasks.classification.Classification` and
the other built-ins are written the same way):

    metrics = {"loss": "minimize", "acc": "maximize"}   # class attribute: every metric it may report,
                                                      # logged as val/<name> and test/<name>, and which
                                                      # way is better (best_<metric>, early stopping, plateau)
    unit = "samples"                                  # or "tokens": what `count` counts
    def loss_sum(self, logits, labels) -> Tensor      # the loss summed over the batch's units
    def count(self, labels) -> int                    # units in the batch (default: len(labels))
    def eval_sums(self, logits, labels) -> dict       # scalar sums that add up over batches and ranks
                                                      # (default: {"loss": loss_sum})
    def summarize(self, sums, count) -> dict          # metric values from the totals (default: sum/count)
    def loss_options(self) -> dict                    # options set that change the loss (see below)
    predicts_from = "inputs"                          # mode=predict reads inputs (a split, images, texts),
    def prediction_rows(self, logits, labels) -> list # and gives per sample its prediction's columns
                                                      # (with labels: the target's too); or "prompts", which
    def generate(self, model, prompt, ...) -> list    # it continues (language models)

One loss path. The task computes the loss from the model's logits (the output itself when it is a
tensor, else its `.logits` or `["logits"]`). A model's own loss (`.loss` or `["loss"]`) is used only
when the output has no logits, i.e. when the task cannot compute it (a contrastive model, say): it is
read as the mean over the task's units of the micro-batch, evaluation then reports only `<split>/loss`,
and the task's `loss_options()` (label smoothing) are refused in one line, since they would do
nothing. A model whose forward takes `labels` gets them, for tuple and dict batches alike.

Batches are `(inputs, labels)` tuples or dicts (`input_ids`, `attention_mask`, `labels`, ...); labels
of -100 (padding tokens) do not count. A rank whose share of a batch is empty gets a stand-in of real
samples marked `Batch.empty`: it counts 0 and its loss is multiplied by 0 (runner/engine/engine.py).

This module imports no torch (the built-in tasks import it when they compute), so the spec's checks
read a task's declared metrics and unit before torch is loaded.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

IGNORE = -100  # label that counts for nothing: padding tokens
_functional: Any = None  # torch.nn.functional once a loss imported it (`functional`)
_COUNTED_IN_PYTHON = 512  # labels: past about this many, listing them costs more than the tensor ops (~25 ns each)


def functional() -> Any:
    """torch.nn.functional, imported at a task's first loss (this module imports no torch). A loss runs every step:
    an import statement in it would go through the import machinery each time (~4 us of a tiny step). A global,
    not functools.cache: torch.compile, tracing a compiled loss, warns at a cached function."""
    global _functional
    if _functional is None:
        import torch.nn.functional as F

        _functional = F
    return _functional


def units_kept(labels: torch.Tensor) -> int | torch.Tensor:
    """The labels that are not IGNORE: an int on the CPU; on an accelerator a 0-dim tensor there. Reading
    it as an int there would wait for every kernel queued before it, each micro-step, and leave the GPU
    idle while the next step is launched (data gathered on the GPU keeps its labels there). A small batch
    of class ids on the CPU is counted in Python: its three tensor ops cost ~40 us in a tiny step (where
    other work has left the caches cold), listing 64 labels ~2 us."""
    if labels.is_cpu and labels.dim() == 1 and len(labels) <= _COUNTED_IN_PYTHON:
        return len(labels) - labels.tolist().count(IGNORE)
    kept = (labels != IGNORE).sum()
    return int(kept) if kept.device.type == "cpu" else kept
Direction = Literal["maximize", "minimize"]

BUILTIN = {"classification": "runner.tasks.classification.Classification",
           "language_modeling": "runner.tasks.language_modeling.LanguageModeling",
           "regression": "runner.tasks.regression.Regression"}


@dataclass(slots=True, init=False)
class Batch:
    """A micro-batch as the engine hands it on; never changed in place (dataclasses.replace makes another).
    Slots and not frozen: a frozen dataclass's fields go in by object.__setattr__ (or its instance dict, made for
    it), which costs each training step ~1.2k instructions more, and a slot is read faster than a dict's key."""

    inputs: Any              # a tensor, or a dict of keyword arguments for the model
    labels: torch.Tensor
    empty: bool = False      # a stand-in for a rank's empty share: forwarded, counted as nothing

    def __init__(self, inputs: Any, labels: torch.Tensor, empty: bool = False):
        self.inputs, self.labels, self.empty = inputs, labels, empty


class Task:
    """The base of every task: see the module docstring for what a subclass implements."""

    metrics: ClassVar[dict[str, Direction]] = {"loss": "minimize"}
    unit: ClassVar[Literal["samples", "tokens"]] = "samples"
    predicts_from: ClassVar[Literal["inputs", "prompts"]] = "inputs"

    def count(self, labels: torch.Tensor) -> int | torch.Tensor:
        """The units of a micro-batch the loss is averaged over: an int, or (labels on an accelerator) a
        0-dim tensor there, which the engine reads only on logging steps (see `units_kept`)."""
        return len(labels)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.loss_sum(logits, labels)")

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-batch sums that add up over batches and ranks; `summarize` turns their totals into values."""
        return {"loss": self.loss_sum(logits, labels)}

    def summarize(self, sums: dict[str, float], count: float) -> dict[str, float]:
        """Metric values (names without the split) from the sums over the whole split."""
        return {name: value / count for name, value in sums.items()}

    def loss_options(self) -> dict[str, Any]:
        """The options set on this task that change its loss: refused for a model that computes its own."""
        return {}

    def prediction_rows(self, logits: torch.Tensor, labels: torch.Tensor | None) -> list[dict[str, Any]]:
        """mode=predict: per sample of a batch, the columns of its prediction (a class and its probabilities,
        a value, ...), with the target's where `labels` are given; a list value spans columns <name>_<i>."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it predicts: define "
                                  "prediction_rows(logits, labels), returning a dict of columns per sample")

    def metric_names(self, split: str) -> list[str]:
        """What this task reports for a split (an instance may report fewer than its class declares)."""
        return [f"{split}/{name}" for name in self.metrics]


def task_class(target: str) -> type[Task]:
    """A task class by dotted path (or a built-in's name), imported without building it."""
    module_name, _, attr = BUILTIN.get(target, target).rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def direction(task: type[Task] | Task, metric: str) -> Direction:
    """Which way `metric` (`<split>/<name>`, or a bare name) is better, as its task declares it."""
    name = metric.rpartition("/")[2]
    if name not in task.metrics:
        raise ValueError(f"{metric}: not a metric {getattr(task, '__name__', type(task).__name__)} declares; "
                         f"it declares {', '.join(sorted(task.metrics))}")
    return task.metrics[name]


def metric_values(task: Task, sums: dict[str, float], count: float, split: str) -> dict[str, float]:
    """`<split>/<name>` -> value from a split's totals; a name the task does not declare is refused (its
    direction would be unknown to best_<metric>, early stopping and plateau)."""
    values = task.summarize(sums, count)
    undeclared = sorted(set(values) - set(type(task).metrics))
    if undeclared:
        raise ValueError(f"{type(task).__name__} reports {', '.join(undeclared)} but does not declare it in `metrics`; "
                         "add it there with its direction (maximize or minimize)")
    return {f"{split}/{name}": value for name, value in values.items()}


def __getattr__(name: str) -> type[Task]:
    # runner.tasks.Classification etc. (conf/task's _target_s, a user's base class) without importing the
    # built-ins' modules, and so torch, when only the protocol is needed
    for path in BUILTIN.values():
        if path.rpartition(".")[2] == name:
            return task_class(path)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
