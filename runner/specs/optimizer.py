"""The optimizer group (conf/optimizer/<name>.yaml): an optimizer class named by `_target_` and its own
arguments, plus runner's keys (kernel choice, lr multipliers, decay of norms and biases), which are
typed fields here and never passed to the class."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from runner.specs.fields import Component, build, component_dict, opt, to_plain


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
        built = build(_OptimizerKeys, own, f"{key}.")
        return cls(target=data.pop("_target_"), params=_checked_conventions(data, f"{key}."),
                   decay_norm_and_bias=built.decay_norm_and_bias, lr_multipliers=built.lr_multipliers, impl=built.impl)


@dataclass(frozen=True)
class _OptimizerKeys:
    decay_norm_and_bias: bool = opt(False, "also decay biases and normalization weights")
    lr_multipliers: Optional[dict[str, float]] = opt(None, "lr multipliers by glob", ge=0)
    impl: Literal["auto", "fused", "foreach", "for_loop"] = opt("auto", "kernel")


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
    built = build(_OptimizerConventions, shared, prefix)
    return {**params, **{k: to_plain(getattr(built, k)) for k in shared}}


_CONVENTIONS = {f.name for f in dataclasses.fields(_OptimizerConventions)}
