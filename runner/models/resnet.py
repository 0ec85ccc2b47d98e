"""torchvision's ResNet-18, randomly initialised (never pretrained: runs are offline)."""
from __future__ import annotations

from torch import nn

from runner.models.cnn import image_shape
from runner.spec import ModelSpec


def build_resnet18(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from torchvision.models import resnet18  # here: torchvision costs seconds to import, paid only when used

    channels, _, _ = image_shape(input_shape, "resnet18")
    model = resnet18(weights=None, num_classes=num_classes)
    if spec.small_stem:
        # CIFAR-style: a 7x7 stride-2 stem plus max-pool would shrink 32x32 inputs to 8x8 before layer1
        model.conv1 = _stem(channels, kernel=3, stride=1)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = _stem(channels, kernel=7, stride=2)
    if spec.dropout > 0:
        model.fc = nn.Sequential(nn.Dropout(spec.dropout), model.fc)
    return model


def _stem(channels: int, kernel: int, stride: int) -> nn.Conv2d:
    conv = nn.Conv2d(channels, 64, kernel, stride=stride, padding=kernel // 2, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits its convs
    return conv
