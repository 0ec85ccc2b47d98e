"""The objective (conf/config.yaml's `objective`, set by each task's YAML): the metric a run returns to
sweeps and ranks its weights by, and which way is better.

The direction is the task's declaration for the metric (runner/tasks: never guessed from a name); it is
filled in after the spec is built (runner/specs/metric_names.py: `with_task_declarations`), and a typed
one that contradicts the declaration is refused there. Everything that ranks runs or weights (the
monitor's best, the best weights, early stopping's objective, the MLflow views, an Optuna study, PBT,
compare, a grid's best job) reads the resolved value, never a default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from runner.specs.fields import opt


@dataclass(frozen=True)
class ObjectiveSpec:
    metric: str = opt("val/acc", "metric returned to sweeps (best value over evaluations)")
    direction: Optional[Literal["maximize", "minimize"]] = opt(
        None, "whether higher is better; null: the direction the task declares for the metric (a direction given "
              "must agree with it)")
