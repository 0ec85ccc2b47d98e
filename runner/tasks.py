"""Tasks: what is specific to the problem. The loss, the metrics, the batch layout, and the unit the
gradient is averaged over (samples, or tokens that are not padding). The engine stays task-agnostic:
it asks a task for a micro-batch's count and loss *sum*, and normalises by the count of the whole
optimizer step on all ranks, so accumulation and ddp/fsdp stay exact in the task's unit.

Batches are `(inputs, labels)` tuples or dicts (`input_ids`, `attention_mask`, `labels`, ...);
labels of -100 do not count. A model whose output carries a `.loss` (HuggingFace style) is trained on
that loss, read as the mean over the task's units of the micro-batch; otherwise the task computes the
loss from the output (a tensor, or an object with `.logits`).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

IGNORE = -100  # label that counts for nothing: padding tokens, padded samples


@dataclass(frozen=True)
class Batch:
    inputs: Any              # a tensor, or a dict of keyword arguments for the model
    labels: torch.Tensor


def split_batch(batch: Any) -> Batch:
    if isinstance(batch, dict):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return Batch(inputs, batch["labels"])
    inputs, labels = batch
    return Batch(inputs, labels)


def to_device(batch: Batch, device: torch.device) -> Batch:
    def move(t: Any) -> Any:
        return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

    inputs = {k: move(v) for k, v in batch.inputs.items()} if isinstance(batch.inputs, dict) else move(batch.inputs)
    return Batch(inputs, move(batch.labels))


def call_model(model: torch.nn.Module, batch: Batch, pass_labels: bool) -> Any:
    if isinstance(batch.inputs, dict):
        return model(**batch.inputs, labels=batch.labels) if pass_labels else model(**batch.inputs)
    return model(batch.inputs)


def accepts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `labels` (and so may return its own loss)."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def logits_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def own_loss(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


class Task:
    name = "task"
    unit = "samples"

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def count(self, labels: torch.Tensor) -> int:
        """The units of a micro-batch the loss is averaged over (an int: read once per step)."""
        return len(labels)

    def loss_sum(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def eval_sums(self, output: Any, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-batch sums that add up over batches and ranks; `metrics` turns their totals into values."""
        raise NotImplementedError

    def metrics(self, sums: dict[str, float], count: float, split: str) -> dict[str, float]:
        raise NotImplementedError

    def metric_names(self, split: str) -> list[str]:
        raise NotImplementedError

    def sum_names(self) -> list[str]:
        """The keys of eval_sums, sorted: every rank reduces them in this order, even with no batch."""
        raise NotImplementedError


class Classification(Task):
    """Cross-entropy (optionally label-smoothed) over classes; top-1 and, with more than 5 classes, top-5 accuracy.
    Labels are class ids, or class probabilities [B, C] (mixup/cutmix)."""

    name = "classification"

    def __init__(self, label_smoothing: float = 0.0, num_classes: int | None = None):
        super().__init__(label_smoothing)
        self.top5 = (num_classes or 0) > 5

    def count(self, labels: torch.Tensor) -> int:
        return len(labels) if labels.is_floating_point() else int((labels != IGNORE).sum())

    def loss_sum(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output).float()
        return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE, label_smoothing=self.label_smoothing)

    def eval_sums(self, output: Any, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = logits_of(output).float()
        hard = labels.argmax(dim=-1) if labels.is_floating_point() else labels
        sums = {"loss": F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE),
                "acc": (logits.argmax(dim=-1) == hard).sum()}
        if self.top5:
            k = min(5, logits.shape[-1])
            sums["top5"] = (logits.topk(k, dim=-1).indices == hard.unsqueeze(-1)).any(dim=-1).sum()
        return sums

    def metrics(self, sums: dict[str, float], count: float, split: str) -> dict[str, float]:
        out = {f"{split}/loss": sums["loss"] / count, f"{split}/acc": sums["acc"] / count}
        if "top5" in sums:
            out[f"{split}/top5"] = sums["top5"] / count
        return out

    def metric_names(self, split: str) -> list[str]:
        return [f"{split}/loss", f"{split}/acc"] + ([f"{split}/top5"] if self.top5 else [])

    def sum_names(self) -> list[str]:
        return ["acc", "loss"] + (["top5"] if self.top5 else [])


class LanguageModeling(Task):
    """Next-token cross-entropy averaged over every token that is not padding (labels -100), exactly,
    across micro-batches and ranks; perplexity. Labels are already the next tokens (the data shifts)."""

    name = "language_modeling"
    unit = "tokens"

    def count(self, labels: torch.Tensor) -> int:
        return int((labels != IGNORE).sum())

    def loss_sum(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output).float()
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORE,
                               label_smoothing=self.label_smoothing)

    def eval_sums(self, output: Any, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = logits_of(output).float()
        return {"loss": F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORE)}

    def metrics(self, sums: dict[str, float], count: float, split: str) -> dict[str, float]:
        loss = sums["loss"] / count
        return {f"{split}/loss": loss, f"{split}/ppl": math.exp(min(loss, 50.0))}

    def metric_names(self, split: str) -> list[str]:
        return [f"{split}/loss", f"{split}/ppl"]

    def sum_names(self) -> list[str]:
        return ["loss"]


class Regression(Task):
    """Mean squared error over samples (targets [B] or [B, k]); mean absolute error as a metric."""

    name = "regression"

    def loss_sum(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        prediction = logits_of(output).float().reshape(labels.shape)
        return F.mse_loss(prediction, labels.float(), reduction="sum") / _per_sample(labels)

    def eval_sums(self, output: Any, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = logits_of(output).float().reshape(labels.shape)
        per = _per_sample(labels)
        return {"loss": F.mse_loss(prediction, labels.float(), reduction="sum") / per,
                "mae": F.l1_loss(prediction, labels.float(), reduction="sum") / per}

    def metrics(self, sums: dict[str, float], count: float, split: str) -> dict[str, float]:
        return {f"{split}/loss": sums["loss"] / count, f"{split}/mae": sums["mae"] / count}

    def metric_names(self, split: str) -> list[str]:
        return [f"{split}/loss", f"{split}/mae"]

    def sum_names(self) -> list[str]:
        return ["loss", "mae"]


def _per_sample(labels: torch.Tensor) -> int:
    return max(labels[0].numel(), 1) if labels.dim() > 1 and len(labels) else 1


TASKS: dict[str, Callable[..., Task]] = {"classification": Classification, "language_modeling": LanguageModeling,
                                         "regression": Regression}


def build_task(spec: "TaskSpec", num_classes: int | None) -> Task:
    """The task `spec.target` with its own arguments, and the data's number of classes where it takes one."""
    from runner.components import build_component

    return build_component("task", spec.target, spec.params, {"num_classes": num_classes})


def ignored(batch: Any) -> Any:
    """A batch whose labels count for nothing: a rank's stand-in when its share of a batch is empty."""
    if isinstance(batch, dict):
        return {**batch, "labels": torch.full_like(batch["labels"], IGNORE)}
    inputs, labels = batch
    return inputs, torch.full_like(labels, IGNORE)
