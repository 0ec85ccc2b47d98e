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

import torch
from tqdm.auto import tqdm

from runner.spec import RunSpec
from runner.tracking import Tracker
from runner.trial import open_trial

log = logging.getLogger(__name__)


def higher_is_better(metric: str) -> bool:
    return metric.endswith(("acc", "accuracy", "f1", "auc"))


class Monitor:
    def __init__(self, spec: RunSpec, tracker: Tracker, total_steps: int, steps_per_epoch: int):
        self.spec, self.tracker = spec, tracker
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.log_every = spec.trainer.log_every_n_steps
        self.best: dict[str, float] = {}
        self.best_step: dict[str, int] = {}
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.early_stopping_best: float | None = None
        self.evals_without_improvement = 0
        self.should_stop = False
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self.samples_seen = 0  # this process's run: the throughput summary
        self._t_last = time.perf_counter()
        show = spec.trainer.progress_bar == "on" or (spec.trainer.progress_bar == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, disable=not show, leave=False)
        self.trial = open_trial(spec)  # None unless this run is an Optuna trial (hparams_search)

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def on_step(self, step: int, loss_sum: torch.Tensor, samples: int, grad_norm: torch.Tensor | None,
                lr: float, skipped_steps: int) -> None:
        self._losses.append(loss_sum)  # summed on log steps: no tensor op per step
        self._samples += samples
        self.samples_seen += samples
        self.bar.update(1)
        if not self.is_log_step(step):
            return
        now = time.perf_counter()
        metrics = {"train/loss": torch.stack(self._losses).sum().item() / self._samples, "lr": lr,
                   "throughput/samples_per_s": self._samples / max(now - self._t_last, 1e-9),
                   "epoch": step / self.steps_per_epoch}
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm.item()
        if self.spec.precision.name == "fp16":
            metrics["fp16/skipped_steps"] = skipped_steps
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            metrics["memory/max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._losses, self._samples, self._t_last = [], 0, time.perf_counter()
        self._record(metrics, step)
        self.bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", samples_s=f"{metrics['throughput/samples_per_s']:.0f}")

    def on_eval(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        self._record(metrics, step)
        for name, value in metrics.items():
            if name not in self.best or _better(name, value, self.best[name]):
                self.best[name], self.best_step[name] = value, step
        text = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        (log.info if self.bar.disable else self.bar.write)(f"epoch {epoch} step {step}: {text}")
        self._watch_early_stopping(metrics)
        if self.trial is not None:
            self.trial.report(metrics)  # raises optuna.TrialPruned when the study's pruner stops this run

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
            log.info("early stopping: %s has not improved for %d evaluations", es.monitor, es.patience)

    def objective(self) -> float:
        metric = self.spec.objective.metric
        values = [v for _, v in self.history.get(metric, [])]
        if not values:
            return math.nan
        return max(values) if self.spec.objective.direction == "maximize" else min(values)

    def finish(self, final: dict[str, float], step: int) -> None:
        self.close()
        self._record(final, step)
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
                "early_stopping_best": self.early_stopping_best,
                "history": {k: [list(p) for p in v] for k, v in self.history.items()}}

    def load_state_dict(self, state: dict, step: int) -> None:
        self.best, self.best_step = dict(state["best"]), dict(state["best_step"])
        self.evals_without_improvement = state["evals_without_improvement"]
        self.early_stopping_best = state["early_stopping_best"]
        self.history = {k: [(int(s), float(v)) for s, v in pts] for k, pts in state["history"].items()}
        self.bar.update(step)


def _better(metric: str, new: float, old: float) -> bool:
    return new > old if higher_is_better(metric) else new < old


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
