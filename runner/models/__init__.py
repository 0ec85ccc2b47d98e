"""Model builders: one module per family, each `(ModelSpec, input_shape, num_classes) -> nn.Module`."""
from __future__ import annotations

from typing import Callable

from torch import nn

from runner.models import cnn, mlp, resnet
from runner.spec import ModelSpec, SpecError

ModelBuilder = Callable[[ModelSpec, tuple[int, ...], int], nn.Module]

BUILDERS: dict[str, ModelBuilder] = {
    "mlp": mlp.build,
    "cnn": cnn.build,
    "resnet18": resnet.build_resnet18,
}

__all__ = ["BUILDERS", "ModelBuilder", "build_model"]


def build_model(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A freshly initialised classifier mapping (batch, *input_shape) to (batch, num_classes) logits.

    Initialisation draws from torch's global RNG: seed it first for a reproducible model.
    """
    builder = BUILDERS.get(spec.name)
    if builder is None:
        raise SpecError(f"model.name: no builder for {spec.name!r}; choose one of {', '.join(sorted(BUILDERS))}")
    return builder(spec, tuple(input_shape), num_classes)
