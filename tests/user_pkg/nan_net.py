"""A user's model whose forward starts producing NaN at a given training step (tests/runner/engine/test_debugging.py)."""
from __future__ import annotations

import math

import torch
from torch import nn


class NanFrom(nn.Module):
    """A linear classifier whose output is multiplied by NaN from its `nan_from`-th training forward with
    gradients on (1-based): the backward of that multiplication then returns NaN too."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, nan_from: int = 3):
        super().__init__()
        self.head = nn.Linear(math.prod(input_shape), num_classes)
        self.nan_from, self.calls = nan_from, 0

    def forward(self, x):
        out = self.head(x.flatten(1))
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls >= self.nan_from:
                out = out * torch.tensor(float("nan"))
        return out


class NanWhenLarge(nn.Module):
    """A linear classifier whose training output turns NaN once a weight's magnitude passes `max_weight`: a run
    with a small lr never gets there, one with a large lr diverges at its second step (tests/runner/search/test_pbt.py)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, max_weight: float = 10.0):
        super().__init__()
        self.head = nn.Linear(math.prod(input_shape), num_classes)
        self.max_weight = max_weight

    def forward(self, x):
        out = self.head(x.flatten(1))
        if self.training and self.head.weight.detach().abs().max() > self.max_weight:
            out = out * torch.tensor(float("nan"))
        return out
