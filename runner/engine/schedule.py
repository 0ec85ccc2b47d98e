"""Learning-rate schedules: any schedule named by `scheduler._target_`, driven one step per optimizer step.

A schedule only scales the optimizer's own lr (the peak, `optimizer.lr`; each group's, with lr
multipliers). `_target_` names either a torch.optim.lr_scheduler class, called with the optimizer (and
`total_steps`, the steps of its phase, when its signature names it), or a function of the step returning
the lr factor, wrapped in a LambdaLR: `factor(step, **own_args)`, given `total_steps` (the run's optimizer
steps) and `warmup_steps` when it names them. The shapes torch lacks in that form are the functions below.
Their lengths are optimizer steps when >= 1 and fractions of the run's total steps when < 1.

`scheduler.warmup` (runner's) runs linearly from peak/(warmup+1) up to the peak, which step `warmup`
reaches; the shape follows it (a function's step still counts from the start of the run).

Extending a run (a resume with a larger trainer.max_steps) rebuilds the schedule for the new length
and continues it from the current step, as if the run had been planned that long from the start; a
schedule driven by evaluations (ReduceLROnPlateau) keeps its state.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import CyclicLR, LambdaLR, LinearLR, OneCycleLR, ReduceLROnPlateau, SequentialLR

from runner.engine.components import build_component, complaint
from runner.specs.components import load_target
from runner.specs.run import SpecError
from runner.specs.scheduler import SchedulerSpec



class Schedule:
    """The lr schedule as the engine drives it: `step()` after every optimizer step, `on_eval()` after every
    evaluation. Past `total_steps` the lr holds its last value (OneCycleLR would raise, cosine would rise).
    """

    def __init__(self, make: Callable[[], Any], optimizer: torch.optim.Optimizer, total_steps: int,
                 monitor: str | None = None, constant_from: int | None = None) -> None:
        self.make, self.optimizer = make, optimizer
        self.scheduler = make()
        self.steps_each_step = not isinstance(self.scheduler, ReduceLROnPlateau)  # (a rebuild makes the same class)
        self.total_steps = total_steps
        self.steps = 0
        self.monitor = monitor  # set for schedules driven by evaluations: the metric on_eval reacts to
        # a LambdaLR whose factor is 1 from this step on (`constant`'s warmup done); None: every step is torch's
        self.constant_from = constant_from if type(self.scheduler) is LambdaLR else None

    def step(self) -> None:
        if self.steps_each_step and self.steps < self.total_steps:
            s = self.scheduler
            if self.constant_from is not None and self._holds(s):
                # the step would set every group's lr to the value it holds: only torch's counters move (its
                # step costs ~10 us, a fifth of the engine's whole budget on a tiny step)
                s.last_epoch += 1
                s._step_count += 1
            else:
                s.step()
        self.steps += 1

    def _holds(self, s: LambdaLR) -> bool:
        """Whether the next step of a constant schedule leaves every lr, and what it records of them, as they are."""
        if s.last_epoch + 1 < self.constant_from or s._step_count < 2:
            return False
        bases, last, i = s.base_lrs, s._last_lr, 0
        # floats only (a tensor's comparison would read it, a device sync); a plain loop: a list built by map, a set
        # of its types and their comparison cost a tiny step ~4k instructions more, a zip() ~2k
        try:
            for group in self.optimizer.param_groups:
                lr = group["lr"]
                if type(lr) is not float or lr != bases[i] or lr != last[i]:
                    return False
                i += 1
        except IndexError:  # a group added since the schedule was built: torch's step records its lr
            return False
        return True

    def on_eval(self, metrics: dict[str, float]) -> None:
        if self.monitor is None:
            return
        if self.monitor not in metrics:
            raise SpecError(f"scheduler.monitor: {self.monitor!r} is not among the evaluation metrics; "
                            f"choose one of {', '.join(sorted(metrics))}")
        self.scheduler.step(float(metrics[self.monitor]))

    def scale_peak(self, index: int, factor: float) -> None:
        """Group `index`'s peak lr changed by `factor` mid-run (PBT's explore; the group's own lr keys are the
        caller's): the schedule's shape goes on from where it is, at the new scale."""
        for part in (self.scheduler, *getattr(self.scheduler, "_schedulers", [])):  # SequentialLR holds its parts
            if hasattr(part, "base_lrs") and index < len(part.base_lrs):
                part.base_lrs[index] = part.base_lrs[index] * factor

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "total_steps": self.total_steps, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        extended = int(state.get("total_steps", self.total_steps)) != self.total_steps
        if not extended or isinstance(self.scheduler, ReduceLROnPlateau):
            self.scheduler.load_state_dict(state["scheduler"])
            return
        # Another length: the saved state holds the old length (T_max, milestones); rebuild for this one
        # from the peak and step it to where the run is, as if the run had been planned this long.
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a replay, not a step
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler = self.make()
            for _ in range(min(self.steps, self.total_steps)):
                self.scheduler.step()


def build_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer, total_steps: int,
                    typed: tuple[str, ...] = ()) -> Schedule:
    """The schedule `spec.target` for a run of `total_steps` optimizer steps (`typed`: the scheduler keys the
    user typed, named where a schedule class fails its first steps)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    fn = load_target("scheduler", spec.target)
    is_class = inspect.isclass(fn)
    by_evaluation = is_class and issubclass(fn, ReduceLROnPlateau)
    name = getattr(fn, "__name__", spec.target)
    warmup = resolve_steps(spec.warmup, total_steps, "scheduler.warmup")
    if warmup and (by_evaluation or fn in NO_WARMUP):
        raise SpecError(f"scheduler.warmup: {spec.warmup:g} is not allowed with {name}, which has no warmup "
                        f"phase; set 0 (onecycle ramps up over pct_start)")
    if warmup >= total_steps:
        raise SpecError(f"scheduler.warmup: {spec.warmup:g} ({warmup} steps) is not allowed; the warmup must be "
                        f"shorter than the run's {total_steps} optimizer steps")
    if by_evaluation != (spec.monitor is not None):
        raise SpecError(f"scheduler.monitor: {name} steps on an evaluation metric; set scheduler.monitor=val/loss"
                        if by_evaluation else f"scheduler.monitor: {spec.monitor!r} is watched only by a schedule driven "
                        f"by evaluations (ReduceLROnPlateau), not by {name}; remove it")
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])

    def make(on: torch.optim.Optimizer = optimizer) -> Any:
        if not is_class:
            return LambdaLR(on, _with_warmup(_factor(spec, total_steps, warmup), warmup))
        # a mode left null is the task's direction (components.resolved_spec fills it in); a bare spec never
        # resolved against a task takes the class's own default
        params = {k: v for k, v in spec.params.items() if not (k == "mode" and v is None)}
        shape = build_component("scheduler", spec.target, params, {"total_steps": total_steps - warmup}, on)
        if not warmup:
            return shape
        ramp = LinearLR(on, start_factor=1 / (warmup + 1), end_factor=1.0, total_iters=warmup)
        return SequentialLR(on, [ramp, shape], [warmup])  # one flat sequence: torch cannot nest them

    if is_class and not by_evaluation:
        _first_steps(make, optimizer, spec, name, total_steps, typed)
    return Schedule(make, optimizer, total_steps, spec.monitor, constant_from=warmup if fn is constant else None)


def _first_steps(make: Callable[[torch.optim.Optimizer], Any], optimizer: torch.optim.Optimizer, spec: SchedulerSpec,
                 name: str, total_steps: int, typed: tuple[str, ...], steps: int = 2) -> None:
    """A schedule class named by _target_ (torch's own, a user's) stepped a few times on a stand-in of the
    optimizer's groups: one that fails at its first steps (StepLR's step_size=0 divides by zero) or gives a
    negative or non-finite lr (ExponentialLR's gamma=-1) is one line naming the key, before the run starts,
    not a traceback after its first step or a run trained at a negative lr."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [torch.zeros(1, requires_grad=True)]}
              for g in optimizer.param_groups]
    stand_in = type(optimizer)(groups) if type(optimizer).__module__.startswith("torch.") else torch.optim.SGD(groups)
    own = [k.partition(".")[2] for k in typed if k != "scheduler._target_"]  # what the user set: where the mistake is
    at = 0
    try:
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a rehearsal, not a step
            warnings.simplefilter("ignore", UserWarning)
            schedule = make(stand_in)
            for at in range(1, min(steps, total_steps) + 1):
                schedule.step()
                bad = [float(g["lr"]) for g in stand_in.param_groups if not (math.isfinite(g["lr"]) and g["lr"] >= 0)]
                if bad:
                    key = f"scheduler.{own[0]}" if own else "scheduler"
                    raise SpecError(f"{key}: {name} gives the learning rate {bad[0]:g} at step {at}; allowed: "
                                    "settings whose learning rate stays finite and >= 0")
    except SpecError:
        raise
    except (ArithmeticError, ValueError, TypeError, IndexError, KeyError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        named = next((k for k in spec.params if k in first), None) or (own[0] if own else None)
        key = f"scheduler.{named}" if named else "scheduler"
        raise SpecError(f"{key}: {name} fails at its step {at} ({type(e).__name__}: {first}); allowed: settings "
                        f"{name} can step with") from None


def _factor(spec: SchedulerSpec, total_steps: int, warmup: int) -> Callable[[int], float]:
    """The function's factor with its own arguments bound; called once now, so a bad argument fails here."""
    fn = load_target("scheduler", spec.target)
    names = inspect.signature(fn).parameters
    given = {k: v for k, v in (("total_steps", total_steps), ("warmup_steps", warmup)) if k in names}
    factor = functools.partial(fn, **given, **spec.params)
    try:
        first = float(factor(warmup))
    except (ValueError, TypeError) as e:
        raise SpecError(complaint("scheduler", fn, e, list(spec.params))) from None
    if not math.isfinite(first) or first < 0:
        raise SpecError(f"scheduler._target_: {spec.target} returned {first!r} at step {warmup}; a schedule returns "
                        "a factor of the peak lr >= 0")
    return factor


def _with_warmup(factor: Callable[[int], float], warmup: int) -> Callable[[int], float]:
    def scaled(step: int) -> float:
        return (step + 1) / (warmup + 1) if step < warmup else float(factor(step))
    return scaled


def resolve_steps(value: float, total_steps: int, key: str) -> int:
    """Optimizer steps from a spec length: whole steps when >= 1, a fraction of `total_steps` when < 1."""
    if value >= 1:
        if not float(value).is_integer():
            raise SpecError(f"{key}: {value!r} is not allowed; give whole optimizer steps (>= 1) "
                            f"or a fraction of all steps (< 1)")
        return int(value)
    return round(value * total_steps)


def _steps(key: str, value: float, total_steps: int, least: int = 1) -> int:
    """A length argument of a shape in optimizer steps; ValueErrors name the key (one line from the runner)."""
    if not value > 0:
        raise ValueError(f"{key}: {value:g} is out of range; allowed: optimizer steps >= 1 or a fraction of all steps > 0")
    if value >= 1 and not float(value).is_integer():
        raise ValueError(f"{key}: {value!r} is not allowed; give whole optimizer steps (>= 1) or a fraction of all steps (< 1)")
    steps = int(value) if value >= 1 else round(value * total_steps)
    if steps < least:
        raise ValueError(f"{key}: {value:g} resolves to {steps} steps; allowed: at least {least} "
                         f"(a fraction of all steps when < 1)")
    return steps


def _ratio(key: str, value: float) -> float:
    if not 0 <= value <= 1:
        raise ValueError(f"{key}: {value!r} is out of range; allowed: a value >= 0 and <= 1")
    return value


def _cosine_factor(ratio: float, at: float, length: float) -> float:
    """The cosine curve from 1 (at 0) down to `ratio` (at `length`), as a factor of the peak lr."""
    return ratio + (1 - ratio) * (1 + math.cos(math.pi * min(at, length) / length)) / 2


# --- the built-in shapes torch lacks as a function of the run's length: factor(step, ...) -> lr / peak ------

def constant(step: int) -> float:
    """The peak throughout (after the warmup, if any)."""
    return 1.0


def cosine(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Cosine annealing from the peak (at the end of the warmup) down to min_lr_ratio x peak at the last step."""
    return _cosine_factor(_ratio("min_lr_ratio", min_lr_ratio), step - warmup_steps, total_steps - warmup_steps)


def multistep(step: int, total_steps: int, warmup_steps: int, milestones: list[float] = (0.5, 0.75),
              gamma: float = 0.1) -> float:
    """x gamma at each milestone (steps from the start of the run, or fractions of it)."""
    at = sorted(_steps("milestones", m, total_steps) for m in milestones)
    for value, where in zip(sorted(milestones), at):
        if not warmup_steps < where < total_steps:
            raise ValueError(f"milestones: {value:g} ({where} steps) is not allowed; every milestone must fall after "
                             f"the warmup ({warmup_steps} steps) and before the end ({total_steps} steps)")
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma: {gamma!r} is out of range; allowed: a value > 0 and <= 1")
    return gamma ** sum(step >= where for where in at)


def exponential(step: int, warmup_steps: int, step_size: int = 100, gamma: float = 0.5) -> float:
    """A smooth step decay: x gamma every step_size steps, a little at every step (a per-step gamma would have
    to be retuned whenever the run length changes)."""
    if step_size < 1 or not 0 < gamma <= 1:
        raise ValueError(f"{'step_size' if step_size < 1 else 'gamma'}: {step_size if step_size < 1 else gamma!r} "
                         "is out of range; allowed: step_size >= 1, 0 < gamma <= 1")
    return gamma ** ((step - warmup_steps) / step_size)


def sgdr(step: int, total_steps: int, warmup_steps: int, cycle_steps: float = 0.25, cycle_mult: int = 1,
         min_lr_ratio: float = 0.0) -> float:
    """Cosine annealing with warm restarts (SGDR): cycles of cycle_steps, each cycle_mult times the last."""
    cycle, ratio = _steps("cycle_steps", cycle_steps, total_steps), _ratio("min_lr_ratio", min_lr_ratio)
    if cycle_mult < 1 or not float(cycle_mult).is_integer():
        raise ValueError(f"cycle_mult: {cycle_mult!r} is not allowed; give a whole number >= 1 (each cycle is that "
                         "many times longer than the last)")
    cycle_mult = int(cycle_mult)
    t = step - warmup_steps
    n = t // cycle if cycle_mult == 1 else int(math.log(t / cycle * (cycle_mult - 1) + 1, cycle_mult))
    start = cycle * n if cycle_mult == 1 else cycle * (cycle_mult ** n - 1) // (cycle_mult - 1)
    return _cosine_factor(ratio, t - start, cycle * cycle_mult ** n)


def wsd(step: int, total_steps: int, warmup_steps: int, decay: float = 0.2, min_lr_ratio: float = 0.0) -> float:
    """Warmup-stable-decay: the peak held, then a linear decay to min_lr_ratio x peak over the last `decay` steps."""
    length, ratio = _steps("decay", decay, total_steps), _ratio("min_lr_ratio", min_lr_ratio)
    stable = total_steps - warmup_steps - length
    if stable < 0:
        raise ValueError(f"decay: {decay:g} ({length} steps) is not allowed; warmup ({warmup_steps}) plus decay must "
                         f"fit in the run's {total_steps} optimizer steps")
    into = step - warmup_steps - stable
    return 1.0 if into <= 0 else 1 + (ratio - 1) * min(into, length) / length


def onecycle(step: int, total_steps: int, pct_start: float = 0.3, base_lr_ratio: float = 0.04) -> float:
    """The one-cycle policy (torch's OneCycleLR, cosine, final_div_factor 1e4): up from base_lr_ratio x peak
    over pct_start of the run, then down to base_lr_ratio x peak / 1e4 at its last step."""
    if not 0 < pct_start < 1 or not 0 < base_lr_ratio <= 1:
        key, value = ("pct_start", pct_start) if not 0 < pct_start < 1 else ("base_lr_ratio", base_lr_ratio)
        raise ValueError(f"{key}: {value!r} is out of range; allowed: 0 < pct_start < 1, 0 < base_lr_ratio <= 1")
    # total + 1 and at least 1.5 steps of ramp: torch's OneCycleLR divides by (pct_start x steps - 1), and
    # ends at step total_steps - 1 where the other shapes end after all steps
    steps = total_steps + 1
    up = float(max(pct_start, 1.5 / steps) * steps) - 1
    low, end = base_lr_ratio, base_lr_ratio / 1e4
    if step <= up:
        return 1 + (low - 1) / 2 * (math.cos(math.pi * step / up) + 1)
    pct = min((step - up) / (steps - 1 - up), 1.0)
    return end + (1 - end) / 2 * (math.cos(math.pi * pct) + 1)


def cyclic(step: int, total_steps: int, cycle_steps: float = 0.25, base_lr_ratio: float = 0.1) -> float:
    """Triangular cyclical lr (CyclicLR): up from base_lr_ratio x peak to the peak over half a cycle, down
    over the other half."""
    cycle = _steps("cycle_steps", cycle_steps, total_steps, least=2)
    up = cycle // 2
    at = step % cycle
    scale = at / up if at <= up else (cycle - at) / (cycle - up)
    return base_lr_ratio + (1 - _ratio("base_lr_ratio", base_lr_ratio)) * scale


# Shapes with a ramp of their own take no warmup in front (ReduceLROnPlateau, driven by evaluations, neither).
NO_WARMUP: tuple[Callable, ...] = (onecycle, cyclic, OneCycleLR, CyclicLR)
