"""Why a run stops before its last step: early stopping, pruning (the Optuna trial's add-on,
runner/search/trial.py), a pause, a signal; early stopping and pruning are decided after an evaluation.

The step loop asks after each evaluation and gets a `Stop` back (or None): a stop is a value, never
an exception raised inside a report, so no reporter can end a run behind the loop's back.
"""
from __future__ import annotations

from dataclasses import dataclass

from runner.addons.base import AddOn
from runner.spec.trainer import EarlyStoppingSpec


@dataclass(frozen=True)
class Stop:
    """Training ends at this step. `pruned`: an Optuna pruner rejected the trial (the run ends
    without its final evaluation and test); else early stopping (the run finishes as usual)."""

    reason: str
    pruned: bool = False
    paused: bool = False  # trainer.stop_at_step: checkpointed to go on later, neither tested nor finished
    signal: int = 0       # SIGTERM/SIGHUP (runner/engine/preemption.py): this step's checkpoint, then the process exits


def pause_due(stop_at_step: int | None, step: int, total_steps: int) -> Stop | None:
    """trainer.stop_at_step reached before the run's last step (there it finishes): the run pauses here."""
    due = stop_at_step is not None and stop_at_step <= step < total_steps
    return Stop(f"paused at step {step} (trainer.stop_at_step)", paused=True) if due else None


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
