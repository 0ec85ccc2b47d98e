"""Batches and model outputs as the engine sees them, whatever their layout: `(inputs, labels)` tuples
or dicts, a loader's stand-in for an empty share, and outputs that are a tensor, carry `.logits` /
`.loss`, or are plain dicts with those keys."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from runner.loader import EmptyShare
from runner.tasks import Batch


def split_batch(batch: Any) -> Batch:
    if isinstance(batch, EmptyShare):
        return dataclasses.replace(split_batch(batch.stand_in), empty=True)
    if isinstance(batch, dict):
        return Batch({k: v for k, v in batch.items() if k != "labels"}, batch["labels"])
    inputs, labels = batch
    return Batch(inputs, labels)


def to_device(batch: Batch, device: torch.device) -> Batch:
    def move(t: Any) -> Any:
        return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

    inputs = {k: move(v) for k, v in batch.inputs.items()} if isinstance(batch.inputs, dict) else move(batch.inputs)
    return dataclasses.replace(batch, inputs=inputs, labels=move(batch.labels))


def call_model(model: torch.nn.Module, batch: Batch, pass_labels: bool) -> Any:
    labels = {"labels": batch.labels} if pass_labels else {}
    if isinstance(batch.inputs, dict):
        return model(**batch.inputs, **labels)
    return model(batch.inputs, **labels)


def accepts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `labels` (and so may compute its own loss)."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits the task computes its loss from, or None when the output carries only its own loss."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def own_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None
