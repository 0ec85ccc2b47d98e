"""A user's models whose signatures differ from runner's mlp: other defaults, other types, a module argument."""
from __future__ import annotations

import math

from torch import nn


class ActNet(nn.Module):
    """Built around an activation given as an argument: `+model.activation={_target_: torch.nn.Tanh}`."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, activation: nn.Module, width: int = 16,
                 dropout: float = 0.5):
        super().__init__()
        self.act = activation
        self.dropout = dropout
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), activation, nn.Dropout(dropout))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


class Tower(nn.Module):
    """`hidden` is one width here, where runner's mlp takes a list."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


class Flat(nn.Module):
    """No Sequential or ModuleList: nothing for fsdp to shard or activation checkpointing to wrap block by block."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16):
        super().__init__()
        self.flatten = nn.Flatten()
        self.hidden = nn.Linear(math.prod(input_shape), width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.hidden(self.flatten(x)).relu())
