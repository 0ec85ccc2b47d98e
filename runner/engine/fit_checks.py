"""Checks that the model, the data and the task fit each other once they are built, in one line each: the
labels a task learns from against the data's, and what a builder returned (DataSplits, a module with
parameters, finite weights). What a model reads against what the data gives is known before either is
built: runner/specs/components.py checks it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.specs.fields import SpecError

if TYPE_CHECKING:
    from runner.specs.run import RunSpec

# The labels each built-in task can learn from, as the first training item holds them (see label_kind).
TASK_LABELS = {"classification": "class ids", "language_modeling": "token ids per position",
               "regression": "real values"}


def label_kind(data: Any) -> str | None:
    """What the first training item's label is: class ids, token ids per position, or real values (None
    when the split cannot be indexed or is empty)."""
    try:
        item = data.train[0]
    except Exception:  # an iterable dataset, an empty split: nothing to look at before training
        return None
    import torch  # here: preflight imports this module before torch is needed

    labels = item.get("labels") if isinstance(item, dict) else item[-1] if isinstance(item, (tuple, list)) else None
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels) if isinstance(labels, (int, float)) else None
    if labels is None:
        return None
    if labels.is_floating_point():
        return "real values"
    return "class ids" if labels.dim() == 0 else "token ids per position"


def check_task_labels(spec: RunSpec, data: Any) -> None:
    from runner import tasks

    built_in = {tasks.task_class(path): name for name, path in tasks.BUILTIN.items()}
    name = built_in.get(tasks.task_class(spec.task.target))  # whatever path names a built-in task
    needs = TASK_LABELS.get(name)
    has = label_kind(data)
    if needs is not None and has is not None and has != needs:
        fits = [name for name, kind in TASK_LABELS.items() if kind == has]
        hint = f"use task={fits[0]}" if fits else "use another dataset"
        raise SpecError(f"task: {name} learns from {needs}, but dataset {spec.dataset.target} labels its "
                        f"samples with {has}; {hint}")


def check_data(spec: RunSpec, data: Any) -> Any:
    """A builder must return DataSplits (or anything with its train, val and test splits)."""
    if not all(hasattr(data, split) for split in ("train", "val", "test")):
        raise SpecError(f"dataset._target_: {spec.dataset.target} returned a {type(data).__name__}, not DataSplits "
                        "(train, val and test splits); return runner.data.DataSplits(train, val, test, ...)")
    return data


def check_model(spec: RunSpec, module: Any, loaded: bool = False) -> Any:
    """What the engine can train: a torch.nn.Module with parameters; once its weights are loaded and its
    frozen parameters frozen (`loaded`), finite weights and some parameters left to train."""
    import torch  # here: preflight imports this module before torch is needed

    if not isinstance(module, torch.nn.Module):
        raise SpecError(f"model._target_: {spec.model.target} returned a {type(module).__name__}, not a "
                        "torch.nn.Module; name a class or function that builds the model")
    if next(module.parameters(), None) is None:
        raise SpecError(f"model._target_: {spec.model.target} has no parameters: there is nothing to train; "
                        "name a model with parameters")
    if not loaded:
        return module
    if spec.model.weights:
        bad = next((name for name, t in module.state_dict().items()
                    if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
        if bad is not None:  # it would train as a divergence at step 1, not naming the file
            raise SpecError(f"model.weights: {spec.model.weights} holds NaN or inf (in {bad}); give finite weights")
    if spec.model.freeze and spec.model.unfreeze_after_epochs is None and not any(
            p.requires_grad for p in module.parameters()):
        raise SpecError(f"model.freeze: {list(spec.model.freeze)} freezes every parameter of {spec.model.target}: "
                        "nothing is left to train; freeze fewer, or unfreeze later with model.unfreeze_after_epochs")
    return module
