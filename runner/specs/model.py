"""The model group (conf/model/<name>.yaml): a model named by `_target_` and its own arguments, plus
runner's fine-tuning keys, which are never passed to the callable."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from runner.specs.fields import Component, SpecError, build, component_dict, opt


@dataclass(frozen=True)
class ModelSpec(Component):
    """A model named by `_target_` (a class or function returning an nn.Module) and its own arguments,
    checked against its signature by runner/specs/components.py (conf/model/<name>.yaml)."""

    target: str = "runner.models.mlp.MLP"
    params: dict = field(default_factory=dict)
    # runner's own keys (fine-tuning), never passed to the callable
    weights: Optional[str] = opt(None, "start from these weights only: a .safetensors file, a runner checkpoint or a "
                                       "state dict; a head whose shape differs is re-initialised")
    freeze: tuple[str, ...] = opt((), "globs of parameter names to freeze, e.g. ['backbone.*']")
    unfreeze_after_epochs: Optional[int] = opt(None, "unfreeze `freeze` at the start of this epoch (gradual "
                                                     "unfreezing); null: frozen for the whole run", ge=0)

    def __to_plain__(self) -> dict:
        own = {"weights": self.weights, "freeze": list(self.freeze), "unfreeze_after_epochs": self.unfreeze_after_epochs}
        return {"_target_": self.target, **self.params, **{k: v for k, v in own.items() if v not in (None, [])}}

    @classmethod
    def parse(cls, data: Any, key: str = "model") -> "ModelSpec":
        data = component_dict(data, key)
        own = {k: data.pop(k) for k in ("weights", "freeze", "unfreeze_after_epochs") if k in data}
        built = build(_FinetuneKeys, own, f"{key}.")
        if built.unfreeze_after_epochs is not None and not built.freeze:  # it would unfreeze nothing
            raise SpecError(f"{key}.unfreeze_after_epochs: {built.unfreeze_after_epochs} needs {key}.freeze (the "
                            f"parameters to unfreeze); set {key}.freeze=['<glob>'] too, or drop it")
        return cls(target=data.pop("_target_"), params=data, weights=built.weights, freeze=built.freeze,
                   unfreeze_after_epochs=built.unfreeze_after_epochs)


@dataclass(frozen=True)
class _FinetuneKeys:
    weights: Optional[str] = opt(None, "weights file")
    freeze: tuple[str, ...] = opt((), "globs of parameter names to freeze")
    unfreeze_after_epochs: Optional[int] = opt(None, "epoch to unfreeze at", ge=0)
