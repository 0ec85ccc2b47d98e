"""runner/models: every family maps digits-shaped and CIFAR-shaped batches to logits and trains."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.models import BUILDERS, build_model
from runner.spec import ModelSpec, SpecError

SHAPES = [(1, 8, 8), (3, 32, 32)]
VARIANTS = [ModelSpec(name="mlp"), ModelSpec(name="mlp", norm=True, dropout=0.1),
            ModelSpec(name="cnn"), ModelSpec(name="cnn", norm=True, dropout=0.1),
            ModelSpec(name="resnet18"), ModelSpec(name="resnet18", small_stem=False, dropout=0.1)]


def test_every_family_is_covered() -> None:
    assert {spec.name for spec in VARIANTS} == set(BUILDERS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: f"{s.name}-norm{s.norm}-drop{s.dropout}-stem{s.small_stem}")
def test_forward_gives_logits_and_backward_reaches_every_parameter(spec: ModelSpec, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(spec, shape, num_classes=7)
    logits = model(torch.randn(4, *shape))
    assert logits.shape == (4, 7)
    nn.functional.cross_entropy(logits, torch.arange(4)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_default_mlp_has_no_dropout_or_norm() -> None:
    model = build_model(ModelSpec(), (1, 8, 8), 10)
    kinds = {type(m) for m in model.modules()}
    assert kinds == {nn.Sequential, nn.Flatten, nn.Linear, nn.ReLU}
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [256, 128, 10]


def test_cnn_pools_down_to_two_by_two_on_digits() -> None:
    model = build_model(ModelSpec(name="cnn", channels=(8, 8, 8)), (1, 8, 8), 10)
    features = model[:-3](torch.randn(2, 1, 8, 8))  # everything before pool, flatten, head
    assert features.shape == (2, 8, 2, 2)


@pytest.mark.parametrize("small_stem, size", [(True, 32), (False, 8)])
def test_resnet18_stem(small_stem: bool, size: int) -> None:
    model = build_model(ModelSpec(name="resnet18", small_stem=small_stem), (1, 32, 32), 10)
    assert model.conv1.in_channels == 1
    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1).eval()
    assert stem(torch.randn(1, 1, 32, 32)).shape[-2:] == (size, size)


def test_image_models_refuse_flat_inputs() -> None:
    with pytest.raises(SpecError, match="use model=mlp"):
        build_model(ModelSpec(name="cnn"), (64,), 10)


def test_unknown_model_names_the_options() -> None:
    with pytest.raises(SpecError, match="choose one of cnn, mlp, resnet18"):
        build_model(ModelSpec(name="vit"), (1, 8, 8), 10)
