"""A user's model with BatchNorm: a Sequential whose halves tests.user_pkg.stages.mlp_stage cuts into pipeline
stages (each holding a BatchNorm1d)."""
from __future__ import annotations

import math

from torch import nn


def bn_mlp(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.BatchNorm1d(width), nn.ReLU(),
                         nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, num_classes))
