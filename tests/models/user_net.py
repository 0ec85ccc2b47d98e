"""A user's own model, outside runner and pointed to only from YAML or the command line."""
from __future__ import annotations

from torch import nn


class WideNet(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 64, depth: int = 2):
        super().__init__()
        if width <= 0:
            raise ValueError(f"width: {width} is out of range; allowed: a value > 0")
        size = 1
        for d in input_shape:
            size *= d
        layers: list[nn.Module] = [nn.Flatten()]
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(size, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


def rows(path: str = "rows.csv"):
    """A user's dataset builder that reads a file the plain way: a missing one raises FileNotFoundError."""
    with open(path) as f:
        return f.read()


def fussy_net(input_shape: tuple[int, ...], num_classes: int, width: int = 8):
    """A user's model whose complaint names no key of its own."""
    raise ValueError("the widths do not add up")


def needs_padding(vocab_size: int, pad_token_id: int) -> nn.Module:
    """A user's token model that needs the data's padding id."""
    return nn.Embedding(vocab_size, 4, padding_idx=pad_token_id)
