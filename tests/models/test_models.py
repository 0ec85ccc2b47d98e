"""runner/models: every family maps digits-shaped and CIFAR-shaped batches to logits and trains."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.models.cnn import CNN
from runner.models.mlp import MLP
from runner.models.resnet import resnet18

SHAPES = [(1, 8, 8), (3, 32, 32)]
VARIANTS = [(MLP, {}), (MLP, {"norm": True, "dropout": 0.1}), (CNN, {}), (CNN, {"norm": True, "dropout": 0.1}),
            (resnet18, {}), (resnet18, {"small_stem": False, "dropout": 0.1})]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fn, kwargs", VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_forward_gives_logits_and_backward_reaches_every_parameter(fn, kwargs: dict, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = fn(input_shape=shape, num_classes=7, **kwargs)
    logits = model(torch.randn(4, *shape))
    assert logits.shape == (4, 7)
    nn.functional.cross_entropy(logits, torch.arange(4)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_default_mlp_has_no_dropout_or_norm() -> None:
    model = MLP((1, 8, 8), 10)
    kinds = {type(m) for m in model.modules()}
    assert kinds == {nn.Sequential, nn.Flatten, nn.Linear, nn.ReLU}
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [256, 128, 10]


def test_cnn_pools_down_to_two_by_two_on_digits() -> None:
    model = CNN((1, 8, 8), 10, channels=[8, 8, 8])
    features = model[:-3](torch.randn(2, 1, 8, 8))  # everything before pool, flatten, head
    assert features.shape == (2, 8, 2, 2)


@pytest.mark.parametrize("small_stem, size", [(True, 32), (False, 8)])
def test_resnet18_stem(small_stem: bool, size: int) -> None:
    model = resnet18((1, 32, 32), 10, small_stem=small_stem)
    assert model.conv1.in_channels == 1
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1).eval()
    assert stem(torch.randn(1, 1, 32, 32)).shape[-2:] == (size, size)


def test_image_models_refuse_flat_inputs() -> None:
    with pytest.raises(ValueError, match="^input_shape: cnn needs image inputs .* use model=mlp"):
        CNN((64,), 10)


@pytest.mark.parametrize("fn, kwargs, key", [(MLP, {"hidden": [0, 128]}, "hidden"), (MLP, {"dropout": 1.0}, "dropout"),
                                             (CNN, {"channels": [8, -1]}, "channels")])
def test_bad_sizes_are_refused_in_one_line_naming_the_key(fn, kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}: "):
        fn((1, 8, 8), 10, **kwargs)
