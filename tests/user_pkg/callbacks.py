"""A user's own engine add-on, named only by `_target_` in trainer.callbacks: it counts what it saw, logs the
counts to the run's tracker after each validation, and keeps them in the run's checkpoints."""
from __future__ import annotations

from typing import Any

import torch

from runner.addons.base import AddOn, EngineView


class StepCounter(AddOn):
    """Counts optimizer steps, training samples and validations; logs `user/steps`, `user/samples` and
    `user/evaluations` (times `scale`) at each validation's step."""

    name = "step_counter"

    def __init__(self, scale: int = 1) -> None:
        if scale < 1:
            raise ValueError(f"scale: {scale} is not allowed; give a whole number >= 1")
        self.scale = scale
        self.steps = self.samples = self.evaluations = 0

    def setup(self, view: EngineView) -> None:
        self.view = view

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> None:
        self.steps += 1
        self.samples += samples

    def after_evaluation(self, metrics: dict[str, float]) -> None:
        self.evaluations += 1
        self.view.tracker.log_metrics({f"user/{k}": v * self.scale for k, v in self.state_dict().items()},
                                      self.view.progress.step)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "samples": self.samples, "evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.steps, self.samples, self.evaluations = state["steps"], state["samples"], state["evaluations"]


class NotAnAddOn:
    """A class that is no engine add-on: trainer.callbacks refuses it."""


class ComposesAConfig(AddOn):
    """Composes the app's config with Hydra's compose API while the job runs, as a user's code may (to read another
    option's values), and writes the optimizer it names to <run dir>/composed.txt."""

    name = "composes_a_config"

    def __init__(self, overrides: list[str]) -> None:
        self.overrides = list(overrides)

    def setup(self, view: EngineView) -> None:
        from pathlib import Path

        from hydra import compose

        cfg = compose("config", overrides=self.overrides)
        (Path(view.spec.run_dir) / "composed.txt").write_text(str(cfg.optimizer._target_))


class HoldsALock(AddOn):
    """Keeps a lock (or, with `what=lambda`, a function) in its state_dict: no checkpoint can store either."""

    name = "holds_a_lock"

    def __init__(self, what: str = "lock") -> None:
        import threading

        self.guard = threading.Lock() if what == "lock" else (lambda x: x)
        self.steps = 0

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "guard": self.guard}


class ReturnsAString(AddOn):
    """Its on_step_end returns a string (meaning "stop") where a hook returns a Stop or None."""

    name = "returns_a_string"

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> Any:
        return "stop" if step == 2 else None


class HoldsForAStopSignal(AddOn):
    """While the file `hold` exists, holds every step after `after` until this process has a stop signal (SIGTERM,
    SIGUSR1): a test that signals a run in the middle of its training then never depends on the run being slower
    than the signal's way to it. Without the file it does nothing, so the run's reference and its resume train as
    they would without it."""

    name = "holds_for_a_stop_signal"

    def __init__(self, hold: str, after: int) -> None:
        self.hold, self.after = hold, after

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> None:
        import os
        import time

        from runner.engine import preemption

        while step > self.after and os.path.exists(self.hold) and not preemption.pending_signal():
            time.sleep(0.01)
