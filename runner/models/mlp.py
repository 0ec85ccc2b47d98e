"""Multi-layer perceptron on flattened inputs."""
from __future__ import annotations

import math

from torch import nn

from runner.spec import ModelSpec


def build(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for hidden in spec.hidden:
        layers.append(nn.Linear(width, hidden))
        if spec.norm:
            layers.append(nn.LayerNorm(hidden))
        layers.append(nn.ReLU())
        # only added when used, so the default model is a pure function of its inputs (exactness tests)
        if spec.dropout > 0:
            layers.append(nn.Dropout(spec.dropout))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
