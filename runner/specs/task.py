"""The task group (conf/task/<name>.yaml): what the loss and metrics are, a task class named by `_target_`
(runner/tasks' or a user's) and its own arguments. The metric names and directions the class declares
are read after the spec is built (runner/specs/metric_names.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from runner.specs.fields import Component


@dataclass(frozen=True)
class TaskSpec(Component):
    """What the loss and metrics are: a task class named by `_target_` (runner/tasks.py's, or a user's) and
    its own arguments, checked against its signature (conf/task/<name>.yaml)."""

    target: str = "runner.tasks.Classification"
    params: dict = field(default_factory=dict)
