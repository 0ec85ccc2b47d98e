"""What the run reports: per-step and per-evaluation metrics, the progress bar, best values,
early stopping, the objective, and the curves plot.

The step loop hands over device tensors; they are read (a device sync) only on log steps.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from runner.spec import RunSpec
from runner.tracking import Tracker
from runner.trial import open_trial

log = logging.getLogger(__name__)


def maximize(spec: RunSpec, metric: str) -> bool:
    """Whether a higher value of `metric` is better: the one place that decides it. The objective
    metric goes the way objective.direction says; any other metric by its kind (accuracy-like up,
    losses and errors down)."""
    if metric in (spec.objective.metric, "objective"):
        return spec.objective.direction == "maximize"
    return metric.rpartition("/")[2].endswith(("acc", "accuracy", "f1", "auc", "top1", "top5"))


class Diverged(RuntimeError):
    """The loss stopped being finite: the run ends FAILED; no checkpoint holds the broken weights."""


class NonFiniteWatch:
    """Counts consecutive steps with a non-finite loss on the device (no sync per step); `check`
    reads it (all ranks together) and raises Diverged once the limit was reached. fp16 may see a few
    such steps that its loss scaler skips; every other precision stops at the first."""

    def __init__(self, spec: RunSpec, device: torch.device):
        self.limit = spec.trainer.max_non_finite_steps if spec.precision.name == "fp16" else 1
        self.spec = spec
        self.streak = torch.zeros((), device=device, dtype=torch.int64)
        self.worst = torch.zeros((), device=device, dtype=torch.int64)
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)

    def on_step(self, step: int, loss_sum: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss_sum)
        self.streak = (self.streak + 1) * bad
        self.first_bad = torch.where(self.streak == 1, step, self.first_bad)
        self.worst = torch.maximum(self.worst, self.streak)

    def check(self, reduce_max) -> None:
        worst, first = reduce_max([self.worst, self.first_bad])
        if int(worst) >= self.limit:
            opt = self.spec.optimizer
            fp16 = ", or use precision=bf16 instead of fp16" if self.spec.precision.name == "fp16" else ""
            raise Diverged(f"the loss is not finite from step {int(first)} on ({int(worst)} step(s) in a row): "
                           f"the run diverged and was stopped; lower optimizer.lr (now {opt.lr:g}) or clip gradients "
                           f"(trainer.clip_grad_norm=1.0){fp16}")


class Monitor:
    """Metrics of one run. Every rank holds one and calls it at the same steps (the training loss is
    reduced across ranks on log steps); only the main rank's tracker logs and only it writes files."""

    def __init__(self, spec: RunSpec, tracker: Tracker, total_steps: int, steps_per_epoch: int,
                 reduce_sum: Callable[[list[torch.Tensor]], list[torch.Tensor]], is_main: bool = True):
        self.spec, self.tracker = spec, tracker
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.reduce_sum, self.is_main = reduce_sum, is_main
        self.unit = "tokens" if spec.task.name == "language_modeling" else "samples"  # what the loss averages over
        self.log_every = spec.trainer.log_every_n_steps
        self.best: dict[str, float] = {}
        self.best_step: dict[str, int] = {}
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.early_stopping_best: float | None = None
        self.evals_without_improvement = 0
        self.should_stop = False
        self.last_eval_step = -1  # the step of the newest validation: the end of training evaluates if it is older
        self._losses: list[torch.Tensor] = []
        self._samples: list[int] = []
        self.samples_seen = 0  # all ranks: the throughput summary
        self._t_last = time.perf_counter()
        show = spec.trainer.progress_bar == "on" or (spec.trainer.progress_bar == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, disable=not (show and is_main), leave=False)
        self.trial = open_trial(spec)  # None unless this run is an Optuna trial (hparams_search)

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def on_step(self, step: int, loss_sum: torch.Tensor, samples: int, grad_norm: torch.Tensor | None,
                lr: float, skipped_steps: int) -> None:
        """`loss_sum` and `samples` are this rank's; the logged train/loss is the mean over all ranks."""
        self._losses.append(loss_sum)  # summed on log steps: no tensor op per step
        self._samples.append(samples)
        self.bar.update(1)
        if not self.is_log_step(step):
            return
        loss, count = self.reduce_sum([torch.stack(self._losses).sum(), torch.tensor(float(sum(self._samples)),
                                                                              device=loss_sum.device)])
        count = int(count.item())
        self.samples_seen += count
        now = time.perf_counter()
        metrics = {"train/loss": loss.item() / max(count, 1), "lr": lr,
                   f"throughput/{self.unit}_per_s": count / max(now - self._t_last, 1e-9),
                   "epoch": step / self.steps_per_epoch}
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm.item()
        if self.spec.precision.name == "fp16":
            metrics["fp16/skipped_steps"] = skipped_steps
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._losses, self._samples, self._t_last = [], [], time.perf_counter()
        self._record(metrics, step)
        self.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", **{f"{self.unit}_s": f"{metrics[f'throughput/{self.unit}_per_s']:.0f}"})

    def on_eval(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        self.last_eval_step = step
        if not metrics:  # an empty split: nothing to report
            return
        self._record(metrics, step)
        for name, value in metrics.items():
            if name not in self.best or self.better(name, value, self.best[name]):
                self.best[name], self.best_step[name] = value, step
        text = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        if self.is_main:
            (log.info if self.bar.disable else self.bar.write)(f"epoch {epoch} step {step}: {text}")
        self._watch_early_stopping(metrics)
        if self.trial is not None:
            self.trial.report(metrics)  # raises optuna.TrialPruned when the study's pruner stops this run

    def better(self, metric: str, new: float, old: float) -> bool:
        return new > old if maximize(self.spec, metric) else new < old

    def _watch_early_stopping(self, metrics: dict[str, float]) -> None:
        es = self.spec.trainer.early_stopping
        if es.monitor is None or es.monitor not in metrics:
            return
        value, ref = metrics[es.monitor], self.early_stopping_best
        improved = ref is None or (value < ref - es.min_delta if es.mode == "min" else value > ref + es.min_delta)
        if improved:
            self.early_stopping_best = value
            self.evals_without_improvement = 0
        else:
            self.evals_without_improvement += 1
        if self.evals_without_improvement >= es.patience:
            self.should_stop = True
            if self.is_main:
                log.info("early stopping: %s has not improved for %d evaluations", es.monitor, es.patience)

    def objective(self) -> float:
        metric = self.spec.objective.metric
        values = [v for _, v in self.history.get(metric, [])]
        if not values:
            return math.nan
        return max(values) if maximize(self.spec, metric) else min(values)

    def finish(self, final: dict[str, float], step: int) -> None:
        """The end of a run: test metrics, the summary metrics a runs table sorts by, the plot."""
        self.close()
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

    def _record(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step)
        for name, value in metrics.items():
            self.history.setdefault(name, []).append((step, value))

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "evals_without_improvement": self.evals_without_improvement,
                "early_stopping_best": self.early_stopping_best, "should_stop": self.should_stop,
                "last_eval_step": self.last_eval_step,
                "history": {k: [list(p) for p in v] for k, v in self.history.items()}}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.best, self.best_step = dict(state["best"]), dict(state["best_step"])
        self.evals_without_improvement = state["evals_without_improvement"]
        self.early_stopping_best = state["early_stopping_best"]
        self.should_stop = bool(state.get("should_stop", False))
        self.last_eval_step = int(state.get("last_eval_step", -1))
        self.history = {k: [(int(s), float(v)) for s, v in pts] for k, pts in state["history"].items()}
        self.bar.update(step)


def plot_curves(history: dict[str, list[tuple[int, float]]], path: Path) -> Path | None:
    """Loss curves (train and val) and accuracy curves (val) against optimizer steps."""
    if "train/loss" not in history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for name, ax in (("train/loss", ax_loss), ("val/loss", ax_loss), ("val/acc", ax_acc)):
        if name in history:
            steps, values = zip(*history[name])
            ax.plot(steps, values, label=name, marker="." if name.startswith("val") else None)
    for ax, title in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        if ax.lines:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
