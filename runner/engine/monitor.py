"""What the run reports: per-step and per-evaluation metrics, the progress bar, best values, the
Optuna trial's intermediate values, the objective, and the curves plot.

Reporting decides nothing: whether to stop early or prune is the step loop's (runner/addons/early_stopping.py,
and the Optuna trial's add-on, runner/search/trial.py). The step loop hands over device tensors; they are read (a device sync)
only on log steps.
"""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from runner.specs import metric_names
from runner.engine.compiling import CompileClock
from runner.engine.flops import FlopRate
from runner.engine.log_window import LogWindow
from runner.specs.run import RunSpec
from runner.tracking.tracker import Tracker

log = logging.getLogger(__name__)


def maximize(spec: RunSpec, metric: str) -> bool:
    """Whether a higher value of `metric` is better. The objective metric goes the way
    objective.direction says; any other as the task declares it (runner/tasks)."""
    if metric in (spec.objective.metric, "objective"):
        return spec.objective.direction == "maximize"
    return metric_names.direction(spec, metric) == "maximize"


class Diverged(RuntimeError):
    """The loss stopped being finite: the run ends FAILED; no checkpoint holds the broken weights."""


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The rates the optimizer's next step uses (read before the scheduler moves them). `lr` is the
    base rate (optimizer.lr as scheduled); with optimizer.lr_multipliers each multiplier's groups also
    log theirs as `lr/x<multiplier>`."""
    groups = optimizer.param_groups
    if "lr_multiplier" not in groups[0]:
        return {"lr": float(groups[0]["lr"])}
    rates = {f"lr/x{g['lr_multiplier']:g}": float(g["lr"]) for g in groups}
    # every group is scaled from its own peak (base x multiplier): any moving group gives the base
    moving = [g for g in groups if g["lr_multiplier"] > 0]
    base = float(moving[0]["lr"]) / moving[0]["lr_multiplier"] if moving else 0.0
    return {"lr": rates.pop("lr/x1", base), **rates}  # the x1 group (unmatched parameters) is the base


class Monitor:
    """Metrics of one run. Every rank holds one and calls it at the same steps (the training loss is
    reduced across ranks on log steps); only the main rank's tracker logs and only it writes files."""

    def __init__(self, spec: RunSpec, tracker: Tracker, total_steps: int, steps_per_epoch: int,
                 reduce_sum: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None, is_main: bool = True):
        """`reduce_sum`: sums across ranks; None in one process."""
        self.spec, self.tracker = spec, tracker
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.reduce_sum, self.is_main = reduce_sum, is_main
        self.unit = metric_names.unit(spec)  # what the loss averages over, as the task declares it
        self.log_every = spec.trainer.log_every_n_steps
        self.best: dict[str, float] = {}
        self.best_step: dict[str, int] = {}
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.window = LogWindow()
        self.samples_seen = 0  # all ranks, in this process: the throughput summary
        self.compile_clock = CompileClock()
        self.step_started = 0.0  # the window's training seconds when the current step started
        self.logs = False  # whether the step now running logs (step_starts); a finder's steps do not
        self.flop_rate = FlopRate(None)  # the engine sets the run's (runner/engine/flops.py)
        self.timed = [0.0, 0.0]  # FLOPs and seconds of every closed window's timed steps, this process
        show = spec.trainer.progress_bar == "on" or (spec.trainer.progress_bar == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, disable=not (show and is_main), leave=False)

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def step_starts(self, step: int) -> bool:
        """Called before each optimizer step (`step`, counted from 1): a step that compiles (or is profiled) is
        timed apart. Returns whether the step logs, kept in `logs` while it runs: only then are its rates and grad
        norm read (asked once a step)."""
        self.step_started = self.window.elapsed()
        self.compile_clock.step_starts()
        self.logs = self.is_log_step(step)
        return self.logs

    def on_step(self, step: int, loss_sum: torch.Tensor, samples: int, grad_norm: torch.Tensor | None,
                lrs: dict[str, float] | None, skipped_steps: int, flops: float = 0.0, timed: bool = True) -> None:
        """`loss_sum`, `samples` and `flops` are this rank's; the logged train/loss is the mean over all ranks.
        `lrs` are the rates this step used (`learning_rates`; read on log steps only). `timed` False: the
        step was profiled, and like a step that compiled it leaves the throughput (its loss still counts)."""
        self.window.add(loss_sum, samples, flops)  # summed on log steps: no tensor op per step
        compiled = self.compile_clock.step_ended(step)
        if compiled is not None:
            self.window.exclude(compiled, samples, flops)
        elif not timed:  # its training seconds: a pause inside it (a FLOP count) is not counted twice
            self.window.exclude(self.window.elapsed() - self.step_started, samples, flops)
        if not self.bar.disable:
            self.bar.update(1)
        if not self.is_log_step(step):
            return
        loss, count, seconds, timed_units, timed_flops = self.window.close(self.reduce_sum, loss_sum.device)
        self.samples_seen += count
        throughput = f"throughput/{self.unit}_per_s"
        metrics = {"train/loss": loss / max(count, 1), **(lrs or {}), "epoch": step / self.steps_per_epoch}
        if timed_units:  # a window of only steps that compiled (or were profiled) has no honest throughput
            metrics.update({throughput: timed_units / max(seconds, 1e-9), **self.flop_rate.metrics(timed_flops, seconds)})
            self.timed = [self.timed[0] + timed_flops, self.timed[1] + seconds]
        if self.compile_clock.steps:
            metrics["compile/seconds"] = self.compile_clock.seconds
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm.item()
        if self.spec.precision.name == "fp16":
            metrics["fp16/skipped_steps"] = skipped_steps
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._record(metrics, step)
        if not self.bar.disable:
            speed = {f"{self.unit}_s": f"{metrics[throughput]:.0f}"} if throughput in metrics else {}
            self.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", **speed)

    def run_rates(self) -> dict[str, float]:
        """TFLOP/s per device and MFU over every timed training step of this process (the run's summary)."""
        return self.flop_rate.metrics(*self.timed)

    def on_eval(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        if not metrics:  # an empty split: nothing to report
            return
        self._record(metrics, step)
        for name, value in metrics.items():
            if name not in self.best or self.better(name, value, self.best[name]):
                self.best[name], self.best_step[name] = value, step
        self.say(f"epoch {epoch} step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def say(self, text: str) -> None:
        """One line for the console and the run log (runner.log): through the logger always, so the file
        gets it; while the bar shows, the console's handler writes above the bar instead of through it."""
        if not self.is_main:
            return
        if self.bar.disable:
            log.info(text)
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm(tqdm_class=type(self.bar)):
            log.info(text)

    def better(self, metric: str, new: float, old: float) -> bool:
        return new > old if maximize(self.spec, metric) else new < old

    def objective(self) -> float:
        metric = self.spec.objective.metric
        values = [v for _, v in self.history.get(metric, [])]
        if not values:
            return math.nan
        return max(values) if maximize(self.spec, metric) else min(values)

    def finish(self, final: dict[str, float], step: int, pruned: bool = False) -> None:
        """The end of a run: test metrics, the summary metrics a runs table sorts by, the plot. A trial
        the Optuna pruner stopped is an ordinary end for a search run: its MLflow run is tagged pruned."""
        self.close()
        if pruned:
            self.tracker.set_tags({"pruned": "true", "runner.outcome": "pruned",
                                   "mlflow.runName": f"{self.tracker.run_name} (pruned)"})
            return
        self._record(final, step)
        best = {name: value for name, value in self.best.items()}
        for name, value in final.items():
            best.setdefault(name, value)
        self.tracker.log_summary(self.objective(), best, step)
        if self.is_main:
            plot = plot_curves(self.history, Path(self.spec.run_dir) / "curves.png")
            if plot is not None:
                self.tracker.log_artifact(plot)

    def close(self) -> None:
        self.bar.close()
        if self.compile_clock.steps:
            self.say(self.compile_clock.summary())

    def _record(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step)
        for name, value in metrics.items():
            self.history.setdefault(name, []).append((step, value))

    def state_dict(self) -> dict:
        """The main rank's record (best values, history); each rank's logging window is saved apart."""
        return {"best": self.best, "best_step": self.best_step, "compile_seconds": self.compile_clock.seconds,
                "history": {k: [list(p) for p in v] for k, v in self.history.items()}}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.best, self.best_step = dict(state["best"]), dict(state["best_step"])
        self.history = {k: [(int(s), float(v)) for s, v in pts] for k, pts in state["history"].items()}
        self.compile_clock.seconds = float(state.get("compile_seconds", 0.0))  # the run's total goes on
        self.bar.update(step)


def plot_curves(history: dict[str, list[tuple[int, float]]], path: Path) -> Path | None:
    """Loss curves (train and val) and accuracy curves (val) against optimizer steps (runner/engine/curves.py)."""
    from runner.engine import curves

    return curves.draw(history, path)
