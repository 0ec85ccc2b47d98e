"""Batches and model outputs as the engine sees them, whatever their layout: `(inputs, labels)` tuples
or dicts, a loader's stand-in for an empty share, and outputs that are a tensor, carry `.logits` /
`.loss`, or are plain dicts with those keys."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from runner.specs.fields import SpecError
from runner.engine.loader import EmptyShare, make_loader
from runner.tasks import Batch, Task


def split_batch(batch: Any) -> Batch:
    if type(batch) is not tuple:  # the usual (inputs, labels) asked first: an isinstance costs a tiny step ~0.5k instructions
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


def on_meta(tree: Any) -> Any:
    """A copy of a batch, or of its inputs (tensors in dicts, lists, tuples), with every tensor an empty one of its
    shape and dtype on the meta device: what a model built on meta runs."""
    from torch.utils._pytree import tree_map

    def meta(t: Any) -> Any:
        return torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t

    if isinstance(tree, Batch):  # a dataclass: one leaf to tree_map
        return Batch(tree_map(meta, tree.inputs), tree_map(meta, tree.labels), tree.empty)
    return tree_map(meta, tree)


def call_model(model: torch.nn.Module, batch: Batch, pass_labels: bool) -> Any:
    inputs = batch.inputs
    if isinstance(inputs, dict):
        return model(**inputs, labels=batch.labels) if pass_labels else model(**inputs)
    return model(inputs, labels=batch.labels) if pass_labels else model(inputs)  # a plain call: no keyword dict built


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


def loss_sum(output: Any, batch: Batch, count: int, task: Task, model: str) -> torch.Tensor:
    """The micro-batch's loss summed over its `count` units: the task's, from the logits; the model's own
    (its mean over the units) only where the output has no logits. A stand-in's is multiplied by 0."""
    logits = output if type(output) is torch.Tensor else logits_of(output)  # this runs every step: a call less
    if logits is not None:
        loss = task.loss_sum(logits, batch.labels)
        if type(loss) is not torch.Tensor:  # vocabulary-sharded logits (tp's loss_parallel): a replicated DTensor
            loss = local_value(loss)
        return loss * 0 if batch.empty else loss
    return own_loss(output, task, model).float() * count  # count is 0 for a stand-in


def eval_sums(output: Any, batch: Batch, count: int, task: Task, model: str) -> dict[str, torch.Tensor]:
    """The task's evaluation sums (all 0 for a stand-in); a model with only its own loss reports only that."""
    logits = logits_of(output)
    if logits is not None and hasattr(logits, "full_tensor"):  # sharded by tensor parallelism: every metric sees them whole
        logits = logits.full_tensor()
    sums = task.eval_sums(logits, batch.labels) if logits is not None else {"loss": own_loss(output, task, model) * count}
    return {name: torch.zeros_like(value) if batch.empty else value for name, value in sums.items()}


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (differentiable), or the tensor itself (asked by type
    first: a failed hasattr on a plain tensor raises and catches an AttributeError, each step)."""
    return t if type(t) is torch.Tensor or not hasattr(t, "to_local") else t.to_local()


def own_loss(output: Any, task: Task, model: str) -> torch.Tensor:
    """The model's own loss, for an output with no logits (the task cannot compute the loss). The
    task's options that would change the loss are refused: they would do nothing."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise SpecError(f"model: {model} returned {type(output).__name__}, which holds neither logits nor a loss; "
                        "return a logits tensor, or an object or dict with .logits or .loss")
    options = task.loss_options()
    if options:  # a key the run accepted must never do nothing
        key, value = next(iter(options.items()))
        raise SpecError(f"task.{key}: {value} cannot apply: {model} returns its own loss and no logits, so the task "
                        f"does not compute the loss; remove task.{key}, or return logits from the model")
    return loss


@torch.no_grad()
def check_loss_options(module: torch.nn.Module, task: Task, stand_in: Batch, pass_labels: bool, model: str) -> None:
    """Before training: a model that returns no logits for one real batch (in eval mode: no BatchNorm
    statistics move, no dropout randomness is drawn) while the task has loss options set is refused."""
    if not task.loss_options():
        return
    training = module.training
    module.eval()
    try:
        output = call_model(module, stand_in, pass_labels)
    finally:
        module.train(training)
    if logits_of(output) is None:
        own_loss(output, task, model)


def example_inputs(spec: Any, data: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One batch of the model's inputs, by the forward argument each goes to (a tuple batch's inputs go to
    the first argument): from validation, else test, else training data."""
    dataset = next(d for d in (data.val, data.test, data.train) if len(d))
    loader = make_loader(dataset, spec.dataset.batch_size, seed=spec.seed, shuffle=False, num_workers=0,
                         pin_memory=False, collate=data.collate)
    inputs = split_batch(next(iter(loader))).inputs
    if isinstance(inputs, dict):
        return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    return {next(iter(inspect.signature(model.forward).parameters)): inputs}
