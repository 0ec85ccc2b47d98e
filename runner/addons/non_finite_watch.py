"""The non-finite watch: a run whose loss stops being finite ends FAILED (runner.engine.monitor.Diverged), and
no checkpoint or evaluation ever sees its weights. An add-on (runner/addons/base.py); the engine also calls
`check` before each evaluation and checkpoint."""
from __future__ import annotations

import torch

from runner.addons.base import AddOn, EngineView
from runner.engine.monitor import Diverged
from runner.engine.parallel import all_reduce_max
from runner.specs.run import RunSpec


class NonFiniteWatch(AddOn):
    """Counts consecutive steps with a non-finite loss; `check` reads the count (all ranks together)
    and raises Diverged once the limit was reached. fp16 may see a few such steps that its loss scaler
    skips; every other precision stops at the first.

    A step only hands over its loss sum (a list append: no tensor op, no device sync per step); `check`
    folds the steps since the last check into the counters on the device in a few tensor ops. As an
    add-on it checks on log steps (every step with trainer.check_finite_every_step); the engine also
    checks before each evaluation and checkpoint (no evaluated or saved weights ever diverged)."""

    name = "non_finite_watch"

    def __init__(self, spec: RunSpec, device: torch.device):
        self.limit = spec.trainer.max_non_finite_steps if spec.precision.name == "fp16" else 1
        self.spec = spec
        self.streak = torch.zeros((), device=device, dtype=torch.int64)
        self._no_streak = self.streak  # never changed in place: each fold assigns new tensors
        self.worst = torch.zeros((), device=device, dtype=torch.int64)
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)
        self.pending: list[torch.Tensor] = []  # loss sums of steps first_pending, first_pending + 1, ...
        self.first_pending = 0
        self.check_every, self.log_every, self.total_steps = spec.trainer.check_finite_every_step, 1, 0

    def setup(self, view: EngineView) -> None:
        self.log_every, self.total_steps = view.spec.trainer.log_every_n_steps, view.total_steps

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> None:
        if not self.pending:  # on_step's, inline: this runs every step
            self.first_pending = step
        self.pending.append(loss_sum)
        if self.check_every or step % self.log_every == 0 or step == self.total_steps:  # the monitor's log steps
            self.check(all_reduce_max)

    def on_step(self, step: int, loss_sum: torch.Tensor) -> None:
        if not self.pending:
            self.first_pending = step
        self.pending.append(loss_sum)

    def _fold(self) -> None:
        if not self.pending:
            return
        losses = torch.stack(self.pending)
        # every step finite (the usual case; `check` reads the counters anyway): the streak ends, nothing else moves
        if bool(torch.isfinite(losses).all()):
            self.streak, self.pending = self._no_streak, []
            return
        bad = ~torch.isfinite(losses)
        index = torch.arange(len(bad), device=bad.device)
        last_good = torch.where(bad, -1, index).cummax(0).values  # -1: no finite step yet in this batch
        # a run of bad steps reaching back to the batch's start continues the streak the last check left
        streak = (index - last_good) + self.streak * (last_good < 0)
        starts = torch.where(streak == 1, index + self.first_pending, -1).max()  # the latest run's first step
        self.first_bad = torch.where(starts >= 0, starts, self.first_bad)
        self.worst = torch.maximum(self.worst, streak.max())
        self.streak, self.pending = streak[-1], []

    def check(self, reduce_max) -> None:
        self._fold()
        worst, first = reduce_max([self.worst, self.first_bad])
        if int(worst) >= self.limit:
            opt = self.spec.optimizer
            fp16 = ", or use precision=bf16 instead of fp16" if self.spec.precision.name == "fp16" else ""
            raise Diverged(f"the loss is not finite from step {int(first)} on ({int(worst)} step(s) in a row): "
                           f"the run diverged and was stopped; lower optimizer.lr (now {opt.lr:g}) or clip gradients "
                           f"(trainer.clip_grad_norm=1.0){fp16}")
