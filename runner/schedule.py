"""Learning-rate schedules: one builder from `SchedulerSpec`, torch.optim.lr_scheduler classes underneath.

A schedule only scales the optimizer's own lr (the peak, `optimizer.lr`). Lengths in the spec
(warmup, milestones, cycle_steps, decay) are optimizer steps when >= 1 and fractions of the run's
total steps when < 1. A warmup runs linearly from peak/(warmup+1) up to the peak, which step
`warmup` reaches; the named shape follows it, so milestones count from the start of the run.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import (ConstantLR, CosineAnnealingLR, CosineAnnealingWarmRestarts, CyclicLR,
                                      ExponentialLR, LambdaLR, LinearLR, LRScheduler, MultiStepLR, OneCycleLR,
                                      ReduceLROnPlateau, SequentialLR, StepLR)

from runner.spec import SchedulerSpec, SpecError

# Shapes with a ramp of their own, or driven by evaluations, take no warmup in front.
NO_WARMUP = ("onecycle", "cyclic", "plateau")

# A phase of the schedule: the scheduler in charge and how many steps it runs (None: to the end).
Phase = tuple[LRScheduler, "int | None"]
Opt = torch.optim.Optimizer


class Schedule:
    """The lr schedule as the engine drives it: `step()` after every optimizer step, `on_eval()` after every
    evaluation. Past `total_steps` the lr holds its last value (OneCycleLR would raise, cosine would rise).
    """

    def __init__(self, scheduler: LRScheduler, total_steps: int, monitor: str | None = None) -> None:
        self.scheduler = scheduler
        self.total_steps = total_steps
        self.steps = 0
        self.monitor = monitor  # set for plateau only: the metric on_eval reacts to

    def step(self) -> None:
        if not isinstance(self.scheduler, ReduceLROnPlateau) and self.steps < self.total_steps:
            self.scheduler.step()
        self.steps += 1

    def on_eval(self, metrics: dict[str, float]) -> None:
        if self.monitor is None:
            return
        if self.monitor not in metrics:
            raise SpecError(f"scheduler.monitor: {self.monitor!r} is not among the evaluation metrics; "
                            f"choose one of {', '.join(sorted(metrics))}")
        self.scheduler.step(float(metrics[self.monitor]))

    @property
    def lr(self) -> float:
        """The current lr of parameter group 0."""
        group = self.scheduler.optimizer.param_groups[0]  # the base lr, whatever group 0's multiplier
        return float(group["lr"]) / group.get("lr_multiplier", 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.scheduler.load_state_dict(state["scheduler"])


def build_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer, total_steps: int) -> Schedule:
    """The schedule named by `spec.name` for a run of `total_steps` optimizer steps."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if spec.name not in _SHAPES:
        raise SpecError(f"scheduler.name: unknown option {spec.name!r}; choose one of {', '.join(sorted(_SHAPES))}")
    warmup = resolve_steps(spec.warmup, total_steps, "scheduler.warmup")
    if warmup and spec.name in NO_WARMUP:
        raise SpecError(f"scheduler.warmup: {spec.warmup:g} is not allowed with {spec.name}, which has no warmup "
                        f"phase; set 0 (onecycle ramps up over pct_start)")
    if warmup >= total_steps:
        raise SpecError(f"scheduler.warmup: {spec.warmup:g} ({warmup} steps) is not allowed; the warmup must be "
                        f"shorter than the run's {total_steps} optimizer steps")
    peaks = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
    phases = _SHAPES[spec.name](spec, optimizer, total_steps, warmup, peaks)
    if warmup:
        ramp = LinearLR(optimizer, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup)
        phases = [(ramp, warmup), *phases]
    return Schedule(_in_sequence(optimizer, phases), total_steps, spec.monitor if spec.name == "plateau" else None)


def resolve_steps(value: float, total_steps: int, key: str) -> int:
    """Optimizer steps from a spec length: whole steps when >= 1, a fraction of `total_steps` when < 1."""
    if value >= 1:
        if not float(value).is_integer():
            raise SpecError(f"{key}: {value!r} is not allowed; give whole optimizer steps (>= 1) "
                            f"or a fraction of all steps (< 1)")
        return int(value)
    return round(value * total_steps)


def _in_sequence(optimizer: torch.optim.Optimizer, phases: list[Phase]) -> LRScheduler:
    # One flat SequentialLR: torch cannot nest one inside another (it restarts phases through get_lr).
    if len(phases) == 1:
        return phases[0][0]
    milestones, at = [], 0
    for _, length in phases[:-1]:
        at += length or 0
        milestones.append(at)
    return SequentialLR(optimizer, [s for s, _ in phases], milestones)


def _per_group_floors(spec: SchedulerSpec, peaks: list[float]) -> bool:
    # torch's cosine schedulers take one absolute eta_min for all groups; with lr_multipliers the groups
    # have different peaks, and a floor of min_lr_ratio x each group's own peak needs a LambdaLR instead.
    return bool(spec.min_lr_ratio) and len(set(peaks)) > 1


def _cosine_factor(ratio: float, at: float, length: float) -> float:
    """The cosine curve from 1 (at 0) down to `ratio` (at `length`), as a factor of the peak lr."""
    return ratio + (1 - ratio) * (1 + math.cos(math.pi * min(at, length) / length)) / 2


def _positive(key: str, value: float, steps: int, least: int = 1) -> int:
    if steps < least:
        raise SpecError(f"scheduler.{key}: {value:g} resolves to {steps} steps; allowed: at least {least} "
                        f"(a fraction of all steps when < 1)")
    return steps


# --- one builder per shape: (spec, optimizer, total steps, warmup steps, peak lrs) -> phases after warmup -----

def _constant(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    return [(ConstantLR(opt, factor=1.0, total_iters=0), None)]


def _step(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    return [(StepLR(opt, step_size=spec.step_size, gamma=spec.gamma), None)]


def _multistep(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    steps = sorted(resolve_steps(m, total, "scheduler.milestones") for m in spec.milestones)
    for value, at in zip(sorted(spec.milestones), steps):
        if not warmup < at < total:
            raise SpecError(f"scheduler.milestones: {value:g} ({at} steps) is not allowed; every milestone must "
                            f"fall after the warmup ({warmup} steps) and before the end ({total} steps)")
    return [(MultiStepLR(opt, milestones=[at - warmup for at in steps], gamma=spec.gamma), None)]


def _exponential(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    # A smooth StepLR: the lr falls by gamma every step_size steps, a little at every step (a per-step gamma
    # would have to be retuned whenever the run length changes).
    return [(ExponentialLR(opt, gamma=spec.gamma ** (1 / spec.step_size)), None)]


def _cosine(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    length, ratio = total - warmup, spec.min_lr_ratio
    if _per_group_floors(spec, peaks):
        return [(LambdaLR(opt, lambda step: _cosine_factor(ratio, step, length)), None)]
    return [(CosineAnnealingLR(opt, T_max=length, eta_min=ratio * peaks[0]), None)]


def _sgdr(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    if not float(spec.cycle_mult).is_integer():
        raise SpecError(f"scheduler.cycle_mult: {spec.cycle_mult:g} is not allowed for sgdr; give a whole number "
                        f">= 1 (torch's CosineAnnealingWarmRestarts multiplies cycle lengths by integers)")
    cycle = _positive("cycle_steps", spec.cycle_steps,
                      resolve_steps(spec.cycle_steps, total, "scheduler.cycle_steps"))
    mult, ratio = int(spec.cycle_mult), spec.min_lr_ratio
    if _per_group_floors(spec, peaks):
        def factor(step: int) -> float:  # where `step` falls in its cycle, the way torch's restarts count
            n = step // cycle if mult == 1 else int(math.log(step / cycle * (mult - 1) + 1, mult))
            start = cycle * n if mult == 1 else cycle * (mult ** n - 1) // (mult - 1)
            return _cosine_factor(ratio, step - start, cycle * mult ** n)
        return [(LambdaLR(opt, factor), None)]
    return [(CosineAnnealingWarmRestarts(opt, T_0=cycle, T_mult=mult, eta_min=ratio * peaks[0]), None)]


def _wsd(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    decay = _positive("decay", spec.decay, resolve_steps(spec.decay, total, "scheduler.decay"))
    stable = total - warmup - decay
    if stable < 0:
        raise SpecError(f"scheduler.decay: {spec.decay:g} ({decay} steps) is not allowed; warmup ({warmup}) plus "
                        f"decay must fit in the run's {total} optimizer steps")
    # The decay is linear to min_lr_ratio; the stable phase holds the peak.
    ramp_down = (LinearLR(opt, start_factor=1.0, end_factor=spec.min_lr_ratio, total_iters=decay), None)
    return [(ConstantLR(opt, factor=1.0, total_iters=0), stable), ramp_down] if stable else [ramp_down]


def _onecycle(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    # cycle_momentum=False: the schedule scales the lr only; cycling would overwrite optimizer.momentum/betas
    # and fails outright for optimizers without them (adagrad, adafactor). total + 1: OneCycleLR ends at
    # step total_steps - 1, the other shapes end after all total_steps steps.
    # OneCycleLR divides by (pct_start x total_steps - 1), so a run of a few steps gets at least one and a
    # half steps of ramp (else ZeroDivisionError, or a ramp that ends before step 0).
    pct_start = max(spec.pct_start, 1.5 / (total + 1))
    return [(OneCycleLR(opt, max_lr=peaks, total_steps=total + 1, pct_start=pct_start,
                        div_factor=1 / spec.base_lr_ratio, cycle_momentum=False), None)]


def _cyclic(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    cycle = _positive("cycle_steps", spec.cycle_steps,
                      resolve_steps(spec.cycle_steps, total, "scheduler.cycle_steps"), least=2)
    # Triangular: up from base_lr_ratio*peak to the peak over half a cycle, down over the other half.
    return [(CyclicLR(opt, base_lr=[spec.base_lr_ratio * p for p in peaks], max_lr=peaks, step_size_up=cycle // 2,
                      step_size_down=cycle - cycle // 2, cycle_momentum=False), None)]


def _plateau(spec: SchedulerSpec, opt: Opt, total: int, warmup: int, peaks: list[float]) -> list[Phase]:
    # Decays once more than `patience` evaluations in a row fail to improve on the best so far (torch's rule).
    # mode is unset only in a spec not resolved against its task (components.resolved_spec fills it in)
    return [(ReduceLROnPlateau(opt, mode=spec.mode or "min", factor=spec.factor, patience=spec.patience,
                               min_lr=[spec.min_lr_ratio * p for p in peaks]), None)]


_SHAPES: dict[str, Callable[[SchedulerSpec, Opt, int, int, list[float]], list[Phase]]] = {
    "constant": _constant, "step": _step, "multistep": _multistep, "exponential": _exponential,
    "cosine": _cosine, "warmup_cosine": _cosine, "sgdr": _sgdr, "wsd": _wsd,
    "onecycle": _onecycle, "cyclic": _cyclic, "plateau": _plateau,
}
