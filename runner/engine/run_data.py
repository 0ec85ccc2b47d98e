"""The data a run trains on, built: the dataset's splits from its builder (runner/engine/components.py), the
fold of one fold's run of a k-fold run (runner/engine/folds.py), then refused in one line where the model
cannot read them or the task cannot learn from their labels. A builder that declares token data is refused
before it runs, with the spec's other checks (components.resolved_spec)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.engine import fit_checks, folds
from runner.engine.components import build_dataset
from runner.specs import components

if TYPE_CHECKING:
    from runner.specs.run import RunSpec


def build_data(spec: RunSpec) -> Any:
    """The dataset's splits, refused in one line where the model cannot read them or the task cannot
    learn from their labels; a k-fold run's fold: its own train and val, the same test."""
    data = folds.for_run(spec, build_dataset(spec))
    components.check_model_reads(spec, "token ids" if getattr(data, "vocab_size", None) is not None else "tensors")
    fit_checks.check_task_labels(spec, data)
    return data
