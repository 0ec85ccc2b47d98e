"""The specs of the training parts named by `_target_`: the task, the optimizer and the lr schedule.

As for models and datasets (runner/spec/run.py), a part's YAML names a callable and gives its arguments;
runner/spec/components.py checks them against the callable's signature once it can be imported. Runner's own
keys of a part (kernel choice, lr multipliers, warmup, the metric a plateau watches) are typed fields here
and are never passed to the callable.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from runner.spec.fields import SpecError, build as _build, opt, to_plain as _to_plain


def component_dict(data: Any, key: str) -> dict:
    """A component's node as a plain dict with a dotted `_target_` (a parsed spec gives its own)."""
    if hasattr(data, "__to_plain__"):
        return data.__to_plain__()
    if not isinstance(data, dict):
        raise SpecError(f"{key}: expected a mapping with a _target_, got {data!r}")
    data = dict(data)
    target = data.get("_target_")
    if not isinstance(target, str) or "." not in target:
        raise SpecError(f"{key}._target_: {target!r} is not a dotted path to a callable; e.g. my_pkg.models.Net")
    return data


class Component:
    """What every spec named by `_target_` shares (its dataclass has `target` and `params` fields)."""

    params: dict

    def with_params(self, params: dict):
        return dataclasses.replace(self, params=dict(params))

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)


@dataclass(frozen=True)
class TaskSpec(Component):
    """What the loss and metrics are: a task class named by `_target_` (runner/tasks.py's, or a user's) and
    its own arguments, checked against its signature (conf/task/<name>.yaml)."""

    target: str = "runner.tasks.Classification"
    params: dict = field(default_factory=dict)

    def __to_plain__(self) -> dict:
        return {"_target_": self.target, **self.params}

    @classmethod
    def parse(cls, data: Any, key: str = "task") -> "TaskSpec":
        data = component_dict(data, key)
        return cls(target=data.pop("_target_"), params=data)


@dataclass(frozen=True)
class OptimizerSpec(Component):
    """An optimizer class named by `_target_` (torch.optim's, timm's or a user's), called with the parameter
    groups and its own arguments (conf/optimizer/<name>.yaml), plus runner's keys, never passed to it."""

    target: str = "torch.optim.Adam"
    params: dict = field(default_factory=lambda: {"lr": 1e-3})
    decay_norm_and_bias: bool = opt(False, "also decay biases and normalization weights (weight_decay applies to "
                                           "matrices only otherwise)")
    lr_multipliers: Optional[dict[str, float]] = opt(None, "lr x multiplier for parameters whose name matches a glob, first match "
                                              "wins, e.g. {'backbone.*': 0.1} (discriminative learning rates; 0 freezes)", ge=0)
    # which kernels an optimizer offers on which device is runner/engine/optim.py's to say (it needs torch)
    impl: Literal["auto", "fused", "foreach", "for_loop"] = opt(
        "auto", "kernel: auto (fused on CUDA where supported, else foreach), fused, foreach, for_loop")

    @property
    def lr(self) -> float:
        """The optimizer's own lr (nan for a class that names it otherwise)."""
        return float(self.params.get("lr", math.nan))

    def __to_plain__(self) -> dict:
        return {"_target_": self.target, **self.params, "decay_norm_and_bias": self.decay_norm_and_bias,
                "lr_multipliers": self.lr_multipliers, "impl": self.impl}

    @classmethod
    def parse(cls, data: Any, key: str = "optimizer") -> "OptimizerSpec":
        data = component_dict(data, key)
        own = {k: data.pop(k) for k in ("decay_norm_and_bias", "lr_multipliers", "impl") if k in data}
        built = _build(_OptimizerKeys, own, f"{key}.")
        return cls(target=data.pop("_target_"), params=_checked_conventions(data, f"{key}."),
                   decay_norm_and_bias=built.decay_norm_and_bias, lr_multipliers=built.lr_multipliers, impl=built.impl)


@dataclass(frozen=True)
class SchedulerSpec(Component):
    """The lr schedule named by `_target_`: a torch.optim.lr_scheduler class (called with the optimizer), or a
    function of the step returning the lr factor (runner/engine/schedule.py's shapes, or a user's), plus runner's keys."""

    target: str = "runner.engine.schedule.constant"
    params: dict = field(default_factory=dict)
    warmup: float = opt(0.0, "warmup: optimizer steps if >= 1, a fraction of all steps if < 1", ge=0)
    monitor: Optional[str] = opt(None, "the evaluation metric a schedule driven by evaluations (ReduceLROnPlateau) watches")

    def __to_plain__(self) -> dict:
        own = {"warmup": self.warmup or None, "monitor": self.monitor}
        return {"_target_": self.target, **self.params, **{k: v for k, v in own.items() if v is not None}}

    @classmethod
    def parse(cls, data: Any, key: str = "scheduler") -> "SchedulerSpec":
        data = component_dict(data, key)
        own = {k: data.pop(k) for k in ("warmup", "monitor") if k in data}
        built = _build(_ScheduleKeys, own, f"{key}.")
        return cls(target=data.pop("_target_"), params=data, warmup=built.warmup, monitor=built.monitor)


@dataclass(frozen=True)
class _OptimizerKeys:
    decay_norm_and_bias: bool = opt(False, "also decay biases and normalization weights")
    lr_multipliers: Optional[dict[str, float]] = opt(None, "lr multipliers by glob", ge=0)
    impl: Literal["auto", "fused", "foreach", "for_loop"] = opt("auto", "kernel")


@dataclass(frozen=True)
class _ScheduleKeys:
    warmup: float = opt(0.0, "warmup steps or fraction", ge=0)
    monitor: Optional[str] = opt(None, "metric to watch")


@dataclass(frozen=True)
class _OptimizerConventions:
    """Keys most optimizers share, checked with their usual ranges before anything is imported (the
    optimizer's own annotations say `float | Tensor`, which admits any value)."""

    lr: float = opt(1e-3, "peak learning rate", gt=0)
    weight_decay: float = opt(0.0, "weight decay", ge=0)
    momentum: float = opt(0.0, "momentum", ge=0, lt=1)
    betas: tuple[float, float] = opt((0.9, 0.999), "betas", ge=0, lt=1)
    eps: float = opt(1e-8, "numerical-stability epsilon", gt=0)


def _checked_conventions(params: dict, prefix: str) -> dict:
    # eps in another form (Adafactor's pair) is the optimizer's own business: its annotation checks it
    shared = {k: v for k, v in params.items() if k in _CONVENTIONS and not (k == "eps" and isinstance(v, (list, tuple)))}
    built = _build(_OptimizerConventions, shared, prefix)
    return {**params, **{k: _to_plain(getattr(built, k)) for k in shared}}


_CONVENTIONS = {f.name for f in dataclasses.fields(_OptimizerConventions)}
