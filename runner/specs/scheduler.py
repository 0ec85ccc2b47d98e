"""The scheduler group (conf/scheduler/<name>.yaml): the lr schedule named by `_target_` and its own
arguments, plus runner's keys (warmup, the metric a plateau schedule watches), never passed to it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from runner.specs.fields import Component, build, component_dict, opt


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
        built = build(_ScheduleKeys, own, f"{key}.")
        return cls(target=data.pop("_target_"), params=data, warmup=built.warmup, monitor=built.monitor)


@dataclass(frozen=True)
class _ScheduleKeys:
    warmup: float = opt(0.0, "warmup steps or fraction", ge=0)
    monitor: Optional[str] = opt(None, "metric to watch")
