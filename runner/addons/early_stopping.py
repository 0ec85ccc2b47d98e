"""Early stopping (trainer.early_stopping): the run stops once its monitored metric has not improved for
`patience` evaluations in a row, decided after each evaluation (an add-on: runner/addons/base.py)."""
from __future__ import annotations

from runner.addons.base import AddOn, Stop
from runner.specs.trainer import EarlyStoppingSpec


class EarlyStopping:
    """Stops once `spec.monitor` has not improved by `min_delta` for `patience` evaluations in a row."""

    def __init__(self, spec: EarlyStoppingSpec) -> None:
        self.spec = spec
        self.best: float | None = None
        self.evals_without_improvement = 0
        self.stopped = False

    def update(self, metrics: dict[str, float]) -> Stop | None:
        es = self.spec
        if es.monitor is None or es.monitor not in metrics:
            return None
        value = metrics[es.monitor]
        improved = self.best is None or (value < self.best - es.min_delta if es.mode == "min"
                                         else value > self.best + es.min_delta)
        if improved:
            self.best, self.evals_without_improvement = value, 0
        else:
            self.evals_without_improvement += 1
        if self.evals_without_improvement < es.patience:
            return None
        self.stopped = True
        return Stop(f"early stopping: {es.monitor} has not improved for {es.patience} evaluations")

    def state_dict(self) -> dict:
        return {"best": self.best, "evals_without_improvement": self.evals_without_improvement, "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        if "early_stopping_best" in state:  # a checkpoint from before early stopping had its own state
            state = {"best": state["early_stopping_best"], "stopped": state.get("should_stop", False),
                     "evals_without_improvement": state["evals_without_improvement"]}
        self.best = state["best"]
        self.evals_without_improvement = int(state["evals_without_improvement"])
        self.stopped = bool(state["stopped"])


class Stopping(AddOn):
    """Early stopping as the step loop asks after each evaluation (an add-on: runner/addons/base.py)."""

    name = "early_stopping"

    def __init__(self, spec: EarlyStoppingSpec) -> None:
        self.early = EarlyStopping(spec)

    @property
    def stopped_early(self) -> bool:
        return self.early.stopped

    def after_evaluation(self, metrics: dict[str, float]) -> Stop | None:
        return self.early.update(metrics)

    def state_dict(self) -> dict:
        return self.early.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.early.load_state_dict(state)
