"""The one protocol between the engine and its add-ons: behaviour around the step loop that is not the
step itself (weight averages, best weights, the model logged to MLflow, the overfit goal, early
stopping, unfreezing, the non-finite watch, the profiler, the stop vote, PBT's mid-run changes, and a
user's own callbacks named by `_target_` under `trainer.callbacks`).

An add-on subclasses `AddOn` and overrides the hooks it needs; every hook is a no-op by default. The
engine calls each hook in one place, for every add-on in its list's order (`AddOns`):

    setup(view)               once, the engine built, before a checkpoint is loaded into it
    load_state_dict(state)    a resumed run: this add-on's entry of the checkpoint (None if it has none)
    on_epoch_start(epoch)     before the epoch's first step (epochs count from 0)
    on_step_end(step, loss_sum, samples) -> Stop | None
                              after optimizer step `step` (1-based): this rank's loss sum (a device
                              tensor: reading it syncs the device) and its sample (or token) count
    after_evaluation(metrics) -> Stop | None
                              after each validation, once the monitor recorded it (best values known)
    on_epoch_end(epochs_done) after an epoch ran to its end (`epochs_done` epochs are complete)
    state_dict()              for a checkpoint (every rank calls it: it may gather; the main rank's is saved)
    after_checkpoint(path)    the main rank wrote that checkpoint
    on_train_end(stop)        the step loop ended: its last step, a stop, a pause (stop.paused) or a prune
    on_run_end(final)         the run finished: tested (`final`: the test metrics), final checkpoint written

A returned `Stop` (below) ends training at this step: the loop decides from values,
never from exceptions raised in a hook. Every rank calls every hook at the same points, so a hook may
run collectives. An add-on sees the engine only through `EngineView`, never the Engine itself.

Adding a built-in add-on is one module here, one key group in conf/trainer/ (its settings) and one line
in the engine's list (runner/engine/engine.py, `Engine._addons`); a user's is one class and one entry of
`trainer.callbacks`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Sequence

from runner.specs.fields import SpecError

if TYPE_CHECKING:
    import torch

    from runner.engine.parallel import DistEnv
    from runner.specs.run import RunSpec
    from runner.tracking.tracker import Tracker


@dataclass(frozen=True)
class Stop:
    """Training ends at this step: early stopping (runner/addons/early_stopping.py; the run finishes as
    usual), a pruner (`pruned`: the Optuna trial's add-on, runner/search/trial.py; the run ends without its
    final evaluation and test), a pause or a signal. A stop is a value a hook returns, never an exception
    raised inside a report, so no reporter can end a run behind the loop's back."""

    reason: str
    pruned: bool = False
    paused: bool = False  # trainer.stop_at_step: checkpointed to go on later, neither tested nor finished
    signal: int = 0       # SIGTERM/SIGHUP (runner/engine/preemption.py): this step's checkpoint, then the process exits


def pause_due(stop_at_step: int | None, step: int, total_steps: int) -> Stop | None:
    """trainer.stop_at_step reached before the run's last step (there it finishes): the run pauses here."""
    due = stop_at_step is not None and stop_at_step <= step < total_steps
    return Stop(f"paused at step {step} (trainer.stop_at_step)", paused=True) if due else None


@dataclass
class Progress:
    """Where the run is: saved in checkpoints as the data position. The engine keeps one object for the
    whole run (a resume fills it in place), so an add-on may hold on to it."""

    step: int = 0              # optimizer steps taken
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of this epoch already trained on, all ranks together
    last_eval_step: int = -1   # one evaluation per step, whatever asks for it


@dataclass(frozen=True)
class EngineView:
    """What an add-on may see of the engine: the run's parts it reads or changes, and a few of the
    engine's services as functions."""

    spec: "RunSpec"
    env: "DistEnv"                  # rank, world, is_main, distributed
    device: "torch.device"
    module: "torch.nn.Module"       # the bare model (no DDP/FSDP/compile wrapper): its tensors are the run's weights
    optimizer: "torch.optim.Optimizer"
    schedule: Any                   # the lr schedule (runner/engine/schedule.py); scale_peak(factors) on a changed lr
    progress: Progress              # live: step, epoch
    total_steps: int
    steps_per_epoch: int
    tracker: "Tracker"
    say: Callable[[str], None]                       # one line for the console and the run log (main rank)
    evaluate: Callable[[str], dict[str, float]]      # a split's metrics: the model's and its averaged weights'
    evaluate_model: Callable[[str], dict[str, float]]  # the model's alone, as its weights are now
    best_step: Callable[[str], "int | None"]         # the step of a metric's best validation so far
    train_batches: Callable[[], Iterable[Any]]       # one pass over the training split, prepared for the model
    forward: Callable[[Any], Any]                    # the bare module on a prepared batch, under the run's autocast
    # time spent inside this context is not training time (throughput leaves it out): the profiler's own work
    untimed: Callable[[], ContextManager[None]] = contextlib.nullcontext
    # the model's modules this rank runs: the bare module, or under pp this rank's stages (`module` is then this
    # rank's part of the model under the whole model's names; `forward` runs the batch through every stage)
    parts: "Sequence[torch.nn.Module]" = ()
    holds_batchnorm: bool = False                    # the whole model has a BatchNorm (every rank answers alike)


class AddOn:
    """An add-on: override the hooks it needs (module docstring). `name` is its checkpoint entry."""

    name: str = ""
    # hooks this add-on overrides but that do nothing in this run (its settings leave them off): not called,
    # so a step pays only for what is switched on
    idle: frozenset[str] = frozenset()
    # a user's add-on: where it was named ("trainer.callbacks[0] (my_pkg.MyCallback)"), which its errors name
    origin: str = ""

    def setup(self, view: EngineView) -> None:
        pass

    def on_epoch_start(self, epoch: int) -> None:
        pass

    def on_step_end(self, step: int, loss_sum: "torch.Tensor", samples: int) -> Stop | None:
        return None

    def after_evaluation(self, metrics: dict[str, float]) -> Stop | None:
        return None

    def on_epoch_end(self, epochs_done: int) -> None:
        pass

    def state_dict(self) -> Any:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass

    def after_checkpoint(self, path: Path) -> None:
        pass

    def on_train_end(self, stop: Stop) -> None:
        pass

    def on_run_end(self, final: dict[str, float]) -> None:
        pass


_HOOKS = ("on_epoch_start", "on_step_end", "after_evaluation", "on_epoch_end", "after_checkpoint", "on_train_end",
          "on_run_end")


class AddOns:
    """The engine's add-ons, each hook called on every add-on that overrides it, in the list's order."""

    def __init__(self, addons: Sequence[AddOn], view: EngineView):
        names = [a.name for a in addons]
        for name in names:
            if not name or names.count(name) > 1:
                raise SpecError(f"trainer.callbacks: two add-ons are named {name!r} (an add-on's name is its checkpoint "
                                f"entry; the run's: {', '.join(names)}); give yours another `name`")
        self.all = list(addons)
        for addon in self.all:
            addon.setup(view)
            if addon.origin:  # a user's state that no checkpoint can hold: said now, before anything is trained
                check_storable(addon, addon.state_dict())
        # only the add-ons that override a hook, and use it in this run, are called for it: a step pays for
        # what is switched on
        self._with = {hook: [a for a in self.all if getattr(type(a), hook) is not getattr(AddOn, hook)
                             and hook not in a.idle] for hook in _HOOKS}
        # the one hook called every step: its add-ons' bound methods, looked up once
        self._step_end = [a.on_step_end for a in self._with["on_step_end"]]

    def on_epoch_start(self, epoch: int) -> None:
        for addon in self._with["on_epoch_start"]:
            addon.on_epoch_start(epoch)

    def on_step_end(self, step: int, loss_sum: "torch.Tensor", samples: int) -> Stop | None:
        stop = None  # every hook runs, also after one stopped; no list is built on a step none stops (nearly all)
        for hook in self._step_end:
            this = hook(step, loss_sum, samples)
            if this is not None:
                this = checked_stop(hook.__self__, "on_step_end", this)
                stop = this if stop is None else first_stop([stop, this])
        return stop

    def after_evaluation(self, metrics: dict[str, float]) -> Stop | None:
        return first_stop([checked_stop(a, "after_evaluation", a.after_evaluation(metrics))
                           for a in self._with["after_evaluation"]])

    def on_epoch_end(self, epochs_done: int) -> None:
        for addon in self._with["on_epoch_end"]:
            addon.on_epoch_end(epochs_done)

    def state_dict(self) -> dict[str, Any]:
        """One entry per add-on that has state (every rank calls it: an add-on may gather)."""
        states = {a.name: a.state_dict() for a in self.all}
        for addon in self.all:
            if addon.origin:
                check_storable(addon, states[addon.name])
        return {name: state for name, state in states.items() if state is not None}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for addon in self.all:
            addon.load_state_dict(states.get(addon.name))

    def after_checkpoint(self, path: Path) -> None:
        for addon in self._with["after_checkpoint"]:
            addon.after_checkpoint(path)

    def on_train_end(self, stop: Stop) -> None:
        for addon in self._with["on_train_end"]:
            addon.on_train_end(stop)

    def on_run_end(self, final: dict[str, float]) -> None:
        for addon in self._with["on_run_end"]:
            addon.on_run_end(final)


def first_stop(stops: Iterable[Stop | None]) -> Stop | None:
    """The stop that wins when several add-ons stop at one step: a signal's (its checkpoint is written and the
    process exits), then a pruner's (no final test), then the first in the list's order."""
    stops = [s for s in stops if s is not None]
    if not stops:
        return None
    return next((s for s in stops if s.signal), None) or next((s for s in stops if s.pruned), None) or stops[0]


def checked_stop(addon: AddOn, hook: str, value: Any) -> Stop | None:
    """What a hook returned, if it is what a hook may return (a Stop or None); else one line naming the add-on."""
    if value is None or isinstance(value, Stop):
        return value
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise SpecError(f"{_who(addon)}: {hook} returned {shown} ({type(value).__name__}); a hook returns "
                    "runner.addons.base.Stop(reason) to end training at this step, or None to go on")


# what a checkpoint loads back (torch.load with weights_only=True): plain values, tensors, and containers of them
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def check_storable(addon: AddOn, state: Any) -> None:
    """One line naming a user's add-on whose state_dict() holds something a checkpoint cannot store (a lock, a
    lambda, an object of its own class), rather than a pickling traceback at its first checkpoint."""
    import torch

    def first_bad(value: Any, where: str) -> tuple[str, Any] | None:
        if isinstance(value, _PLAIN + (torch.Tensor, torch.dtype, torch.device, torch.Size)):
            return None
        if isinstance(value, dict):
            for k, v in value.items():
                found = (where, k) if not isinstance(k, _PLAIN) else first_bad(v, f"{where}[{k!r}]")
                if found:
                    return found
            return None
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return next((found for i, v in enumerate(value) if (found := first_bad(v, f"{where}[{i}]"))), None)
        return where, value

    found = first_bad(state, "state_dict()")
    if found is not None:
        where, value = found
        raise SpecError(f"{_who(addon)}: {where} is {type(value).__module__}.{type(value).__qualname__}, which a "
                        "checkpoint cannot store; return numbers, strings, tensors and lists or dicts of them "
                        "(leave out locks, functions and other objects, or rebuild them in load_state_dict)")


def _who(addon: AddOn) -> str:
    return addon.origin or f"add-on {addon.name!r} ({type(addon).__module__}.{type(addon).__qualname__})"

