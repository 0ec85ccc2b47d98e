"""torchvision's ResNet-18, randomly initialised (never pretrained: runs are offline)."""
from __future__ import annotations

from torch import nn

from runner.models.cnn import image_shape
from runner.models.zoo import torchvision_model


def resnet18(input_shape: tuple[int, ...], num_classes: int, small_stem: bool = True, dropout: float = 0.0) -> nn.Module:
    """ResNet-18; `small_stem`: a 3x3 stride-1 stem without max-pool, for 32x32 and smaller images
    (the same stem as model=torchvision's small_stem: one implementation, in models/zoo.py)."""
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout: {dropout} is out of range; allowed: 0 <= dropout < 1")
    image_shape(input_shape, "resnet18")
    model = torchvision_model("resnet18", num_classes, tuple(input_shape), small_stem=small_stem)
    if dropout > 0:
        model.fc = nn.Sequential(nn.Dropout(dropout), model.fc)
    return model
