"""A small VGG-style convnet: 3x3 conv blocks, max-pooling, global average pool, linear head."""
from __future__ import annotations

from torch import nn

from runner.spec import ModelSpec, SpecError


def image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    """(channels, height, width), or a SpecError saying the dataset does not give images."""
    if len(input_shape) != 3:
        raise SpecError(f"model.name: {model} needs image inputs (channels, height, width), "
                        f"the dataset gives shape {list(input_shape)}; use model=mlp")
    return input_shape  # type: ignore[return-value]


def build(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels, height, width = image_shape(input_shape, "cnn")
    size = min(height, width)
    layers: list[nn.Module] = []
    for out in spec.channels:
        # BatchNorm's own shift makes a conv bias redundant
        layers.append(nn.Conv2d(channels, out, 3, padding=1, bias=not spec.norm))
        if spec.norm:
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU())
        # stop pooling at 2x2 so later blocks still see spatial structure (8x8 digits: 8 -> 4 -> 2)
        if size >= 4:
            layers.append(nn.MaxPool2d(2))
            size //= 2
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if spec.dropout > 0:
        layers.append(nn.Dropout(spec.dropout))
    layers.append(nn.Linear(channels, num_classes))
    return nn.Sequential(*layers)
