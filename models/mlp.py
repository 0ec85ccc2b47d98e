"""Multi-layer perceptron on flattened inputs."""
from __future__ import annotations

import math

from torch import nn


def MLP(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] = (256, 128), dropout: float = 0.0,
        norm: bool = False) -> nn.Sequential:
    """Linear layers with ReLU (and LayerNorm when `norm`) between them, then a linear head."""
    if any(h <= 0 for h in hidden):
        raise ValueError(f"hidden: {list(hidden)} is not allowed; every width must be > 0")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout: {dropout} is out of range; allowed: 0 <= dropout < 1")
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for size in hidden:
        layers.append(nn.Linear(width, size))
        if norm:
            layers.append(nn.LayerNorm(size))
        layers.append(nn.ReLU())
        # only added when used, so the default model is a pure function of its inputs (exactness tests)
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
