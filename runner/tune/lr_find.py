"""The learning-rate finder (`tune=lr_find`): the lr rises exponentially from tune.min_lr to tune.max_lr,
one optimizer step of the run each, until the loss diverges; then the weights and optimizer are put back.

The loss a step computes is that of the weights the previous step's lr made, so each point pairs a loss
with the lr before it. The sweep smooths the loss as it goes by an exponential moving average
(bias-corrected, so its first points are not pulled towards 0) and stops once that exceeds
tune.diverge_factor x its best, or the loss is not finite. Such an average lags: by beta/(1-beta) steps,
a factor of 2.5 in lr at the defaults. So the analysis smooths the recorded curve again by a window
centred on each point, as long as the average's memory (no lag), and suggests where that falls fastest
against log(lr) (its slope averaged over the same window), before its minimum: far enough below
divergence to train stably, high enough to train fast. The minimum is where the loss starts to rise:
where divergence begins.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from runner.specs.run import RunSpec, SpecError
from runner.specs.tune import TuneSpec
from runner.tune.probing import mean_loss, probing, set_base_lr, step_batches

log = logging.getLogger(__name__)


@dataclass
class LrCurve:
    lrs: list[float] = field(default_factory=list)       # the lr whose step made the weights of each point
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    diverged_at: float | None = None                     # the lr of the point that tripped the divergence rule
    stop_reason: str = "reached tune.max_lr"
    smoothing: float = 0.0
    diverge_factor: float = math.inf

    def finite(self) -> tuple[list[float], list[float]]:
        """The points with a finite loss, and their loss smoothed without lag (centred)."""
        points = [(lr, loss) for lr, loss in zip(self.lrs, self.losses) if math.isfinite(loss)]
        # the divergence's losses capped where the sweep's rule stops: a blow-up's thousands would
        # otherwise lift the points half a window before it. Only past the lowest loss: the losses before it,
        # at the low learning rates, are drawn as measured (capped, a start at 2.3 showed as a flat 1.33)
        cap = self.diverge_factor * min((s for s in self.smoothed if math.isfinite(s)), default=math.inf)
        lowest = min(range(len(points)), key=lambda i: points[i][1], default=0)
        return [lr for lr, _ in points], centred([min(loss, cap) if i > lowest else loss
                                                  for i, (_, loss) in enumerate(points)], self.smoothing)


@dataclass
class LrSuggestion:
    lr: float                    # rounded to two significant digits: the value printed is the value applied
    steepest_lr: float
    slope: float                 # smoothed loss change per e-fold of lr at the steepest point (negative)
    lowest_lr: float             # where the smoothed loss is lowest
    lowest_loss: float
    diverged_at: float | None
    reason: str                  # why this value, in words


def schedule(min_lr: float, max_lr: float, steps: int) -> list[float]:
    """The sweep's lrs: exponential from min_lr to max_lr in `steps` steps."""
    return [min_lr * (max_lr / min_lr) ** (i / (steps - 1)) for i in range(steps)]


def centred(values: list[float], beta: float) -> list[float]:
    """The mean over a window centred on each point, as long as the moving average's memory (beta/(1-beta)
    points): as smooth, without its lag, and a point's neighbours only move it (the divergence's losses
    reach back half a window, not over the whole curve)."""
    half = round(beta / (1 - beta) / 2)
    out = []
    for i in range(len(values)):
        window = values[max(i - half, 0):i + half + 1]
        out.append(sum(window) / len(window))
    return out


def sweep(step: Callable[[float], float], lrs: list[float], smoothing: float, diverge_factor: float) -> LrCurve:
    """Runs `step(lr)` (the mean loss of the weights before that step) for each lr until divergence."""
    curve = LrCurve(smoothing=smoothing, diverge_factor=diverge_factor)
    average, best, previous = 0.0, math.inf, None
    for lr in lrs:
        loss = step(lr)
        if previous is not None:
            n = len(curve.lrs) + 1
            curve.lrs.append(previous)
            curve.losses.append(loss)
            if not math.isfinite(loss):
                curve.smoothed.append(math.inf)
                curve.diverged_at, curve.stop_reason = previous, "the loss stopped being finite"
                break
            average = smoothing * average + (1 - smoothing) * loss
            smoothed = average / (1 - smoothing ** n)
            curve.smoothed.append(smoothed)
            best = min(best, smoothed)
            if smoothed > diverge_factor * best:
                curve.diverged_at = previous
                curve.stop_reason = f"the smoothed loss passed {diverge_factor:g} x its best"
                break
        previous = lr
    return curve


def suggest(curve: LrCurve) -> LrSuggestion:
    """The steepest descent of the loss smoothed without lag against log(lr), before its minimum."""
    lrs, smoothed = curve.finite()
    if len(lrs) < 3:
        raise SpecError(f"tune.min_lr: the loss diverged within {len(curve.lrs)} steps of the sweep; lower "
                        f"tune.min_lr (the sweep started at {curve.lrs[0] if curve.lrs else math.nan:g})")
    x, y = np.log(np.array(lrs)), np.array(smoothed)
    lowest = int(np.argmin(y))
    slopes = np.array(centred(list(np.gradient(y, x)), curve.smoothing))  # a derivative multiplies the noise
    start = min(len(y) // 10, max(lowest - 2, 0))  # the first points' windows are cut short
    if lowest - start >= 2:
        steepest = start + int(np.argmin(slopes[start:lowest + 1]))
        lr, slope = float(np.exp(x[steepest])), float(slopes[steepest])
        reason = "steepest descent of the smoothed loss"
    else:  # the loss only rose: the fall, if any, lies below the sweep
        steepest, slope = lowest, 0.0
        lr = float(np.exp(x[lowest])) / 10
        reason = "the loss never fell within the sweep (lower tune.min_lr); a tenth of the lowest point's lr"
    return LrSuggestion(lr=float(f"{lr:.2g}"), steepest_lr=lr, slope=slope, lowest_lr=float(np.exp(x[lowest])),
                        lowest_loss=float(y[lowest]), diverged_at=curve.diverged_at, reason=reason)


def find_lr(engine, tune: TuneSpec) -> LrCurve:
    """Sweeps the engine's own training steps over the lr; its weights, optimizer and the rest are put back."""
    if not math.isfinite(engine.spec.optimizer.lr):
        raise SpecError(f"tune: lr_find sweeps optimizer.lr, which {engine.spec.optimizer.target} does not take; "
                        "choose an optimizer with an lr")
    lrs = schedule(tune.min_lr, tune.max_lr, tune.steps)
    with probing(engine):
        engine.model.train()
        batches = step_batches(engine)

        taken = iter(range(1, tune.steps + 1))

        def step(lr: float) -> float:
            set_base_lr(engine, lr)
            loss_sum, count, _ = engine.train_step(next(batches))
            loss, n = mean_loss(loss_sum, count, engine.device), next(taken)
            if n % 50 == 0 and engine.env.is_main:  # a long sweep shows it is moving
                log.info("lr_find: step %d of at most %d, lr %.2g, loss %.4g", n, tune.steps, lr, loss)
            return loss

        curve = sweep(step, lrs, tune.smoothing, tune.diverge_factor)
    return curve


def peak_note(spec: RunSpec) -> str:
    """What optimizer.lr is to the run's schedule: every schedule scales it, some rise to it."""
    name = spec.scheduler.target.rsplit(".", 1)[-1]
    if name in ("onecycle", "OneCycleLR"):
        return "the peak of the one-cycle schedule, which rises to it from base_lr_ratio x peak"
    if name in ("cyclic", "CyclicLR"):
        return "the peak of each cycle of the cyclic schedule"
    if spec.scheduler.warmup:
        return f"the peak the schedule ({name}) reaches after its warmup (scheduler.warmup={spec.scheduler.warmup:g})"
    return f"the lr the schedule ({name}) starts from"


def describe(spec: RunSpec, curve: LrCurve, s: LrSuggestion) -> list[str]:
    """The report: what the sweep did, why this lr, and the override to use."""
    end = f"{curve.stop_reason} at lr {curve.diverged_at:.2g}" if curve.diverged_at else curve.stop_reason
    lines = [f"lr_find: {len(curve.lrs)} steps from lr {curve.lrs[0]:.2g} to {curve.lrs[-1]:.2g}; stopped: {end}",
             f"  {s.reason} at lr {s.steepest_lr:.2g}" + (f" ({s.slope:.3g} per e-fold of lr)" if s.slope else ""),
             f"  lowest smoothed loss {s.lowest_loss:.4g} at lr {s.lowest_lr:.2g}: above it the loss rises"]
    if s.diverged_at:
        lines.append(f"  margin: the suggestion is {s.lowest_lr / s.lr:.3g}x below where divergence begins (lr "
                     f"{s.lowest_lr:.2g}) and {s.diverged_at / s.lr:.3g}x below where the sweep stopped (lr {s.diverged_at:.2g})")
    else:
        # the last lr measured is tune.max_lr only where the sweep ran its every step
        last = (f"tune.max_lr={curve.lrs[-1]:.2g}" if math.isclose(curve.lrs[-1], spec.tune.max_lr, rel_tol=1e-6)
                else f"lr {curve.lrs[-1]:.2g}, the last measured (tune.max_lr={spec.tune.max_lr:g} was not reached)")
        lines.append(f"  margin: no divergence up to {last}; the suggestion is "
                     f"{s.lowest_lr / s.lr:.3g}x below the lowest loss")
    lines.append(f"  suggested: optimizer.lr={s.lr:g}   ({peak_note(spec)}; now {spec.optimizer.lr:g})")
    return lines


def plot(curve: LrCurve, s: LrSuggestion, path: Path) -> Path:
    """Loss against lr (log axis), raw and smoothed, the suggestion and the divergence marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        lrs, smoothed = curve.finite()
        ax.plot(lrs, [loss for loss in curve.losses if math.isfinite(loss)], color="0.75", lw=1, label="loss")
        ax.plot(lrs, smoothed, color="C0", lw=2, label="smoothed loss")
        ax.axvline(s.lr, color="C2", ls="--", label=f"suggested lr {s.lr:g}")
        if s.diverged_at:
            ax.axvline(s.diverged_at, color="C3", ls=":", label=f"diverged at {s.diverged_at:.2g}")
        values = smoothed
        top = min(max(values), 2 * values[0] - s.lowest_loss) if values[0] > s.lowest_loss else max(values)
        span = max(top - s.lowest_loss, 1e-12)
        ax.set_ylim(s.lowest_loss - 0.1 * span, top + 0.1 * span)  # the divergence's spike would flatten the rest
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("training loss")
        ax.set_title("lr_find")
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
