"""`trainer.overfit_batches` (debug=overfit): the goal of overfitting a few batches, an add-on
(runner/addons/base.py). The data is limited to those batches by runner/engine/debugging.py; this stops
the run once the goal is reached and says at the end whether it was."""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from runner.addons.base import AddOn, EngineView, Progress, Stop
from runner.specs.run import RunSpec


class OverfitGoal(AddOn):
    """trainer.overfit_batches: the run stops once the training loss of each of the last pass's steps is
    below overfit_target_loss, and says at the end whether it got there."""

    name = "overfit_goal"

    def __init__(self, spec: RunSpec, steps_per_pass: int, reduce_sum: Callable):
        self.on = spec.trainer.overfit_batches > 0
        self.target = spec.trainer.overfit_target_loss
        self.reduce_sum = reduce_sum
        self.recent: deque[float] = deque(maxlen=max(steps_per_pass, 1))
        self.reached_at: int | None = None
        self.say: Callable[[str], None] = print
        self.progress = Progress()
        if not self.on:
            self.idle = frozenset({"on_step_end", "on_train_end"})

    def setup(self, view: EngineView) -> None:
        self.say, self.progress = view.say, view.progress

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> Stop | None:
        if not self.on:
            return None
        total, count = self.reduce_sum([loss_sum.detach().double(), torch.tensor(float(samples), dtype=torch.float64,
                                                                                   device=loss_sum.device)])
        self.recent.append(float(total) / max(float(count), 1.0))  # a sync per step: only under this debug key
        if len(self.recent) == self.recent.maxlen and max(self.recent) < self.target:
            self.reached_at = step
            return Stop(f"overfit: reached, training loss {max(self.recent):.4g} < {self.target:g} at step {step}")
        return None

    def state_dict(self) -> dict | None:
        """The last pass's losses (every rank holds the same): a resumed run reaches the goal at the same step."""
        return {"recent": list(self.recent), "reached_at": self.reached_at} if self.on else None

    def load_state_dict(self, state: dict | None) -> None:
        if state:  # none in a checkpoint written before the goal was checkpointed
            self.recent.extend(state["recent"])
            self.reached_at = state["reached_at"]

    def on_train_end(self, stop: Stop) -> None:
        if self.on:
            self.say(self.summary(self.progress.step))

    def summary(self, step: int) -> str:
        if self.reached_at is not None:
            return f"overfit: reached, training loss {max(self.recent):.4g} < {self.target:g} at step {self.reached_at}"
        last = f"{self.recent[-1]:.4g}" if self.recent else "none"
        return (f"overfit: not reached, training loss {last} after {step} steps (target {self.target:g}); "
                f"raise trainer.max_steps or optimizer.lr")
