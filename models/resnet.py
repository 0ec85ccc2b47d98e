"""torchvision's ResNet-18, randomly initialised (never pretrained: runs are offline)."""
from __future__ import annotations

from torch import nn

from runner.models.cnn import image_shape


def resnet18(input_shape: tuple[int, ...], num_classes: int, small_stem: bool = True, dropout: float = 0.0) -> nn.Module:
    """ResNet-18; `small_stem`: a 3x3 stride-1 stem without max-pool, for 32x32 and smaller images."""
    from torchvision import models  # here: torchvision costs seconds to import, paid only when used

    if not 0 <= dropout < 1:
        raise ValueError(f"dropout: {dropout} is out of range; allowed: 0 <= dropout < 1")
    channels, _, _ = image_shape(input_shape, "resnet18")
    model = models.resnet18(weights=None, num_classes=num_classes)
    if small_stem:
        # CIFAR-style: a 7x7 stride-2 stem plus max-pool would shrink 32x32 inputs to 8x8 before layer1
        model.conv1 = _stem(channels, kernel=3, stride=1)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = _stem(channels, kernel=7, stride=2)
    if dropout > 0:
        model.fc = nn.Sequential(nn.Dropout(dropout), model.fc)
    return model


def _stem(channels: int, kernel: int, stride: int) -> nn.Conv2d:
    conv = nn.Conv2d(channels, 64, kernel, stride=stride, padding=kernel // 2, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits its convs
    return conv
