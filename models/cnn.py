"""A small VGG-style convnet: 3x3 conv blocks, max-pooling, global average pool, linear head."""
from __future__ import annotations

from torch import nn



def image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    """(channels, height, width), or a one-line error saying the dataset does not give images."""
    if len(input_shape) != 3:
        raise ValueError(f"input_shape: {model} needs image inputs (channels, height, width), "
                         f"the dataset gives shape {list(input_shape)}; use model=mlp")
    return input_shape  # type: ignore[return-value]


def CNN(input_shape: tuple[int, ...], num_classes: int, channels: list[int] = (32, 64), dropout: float = 0.0,
        norm: bool = True) -> nn.Sequential:
    """3x3 conv blocks (BatchNorm when `norm`), max-pooling down to 2x2, global average pool, linear head."""
    if any(c <= 0 for c in channels):
        raise ValueError(f"channels: {list(channels)} is not allowed; every width must be > 0")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout: {dropout} is out of range; allowed: 0 <= dropout < 1")
    widths = channels
    channels, height, width = image_shape(input_shape, "cnn")
    size = min(height, width)
    layers: list[nn.Module] = []
    for out in widths:
        # BatchNorm's own shift makes a conv bias redundant
        layers.append(nn.Conv2d(channels, out, 3, padding=1, bias=not norm))
        if norm:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU())
        # stop pooling at 2x2 so later blocks still see spatial structure (8x8 digits: 8 -> 4 -> 2)
        if size >= 4:
            layers.append(nn.MaxPool2d(2))
            size //= 2
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(channels, num_classes))
    return nn.Sequential(*layers)
