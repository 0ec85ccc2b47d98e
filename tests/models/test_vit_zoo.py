"""runner/models/vit.py and zoo.py: shapes, learning, local weights and one-line errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from runner.models.vit import ViT
from runner.models.zoo import timm_model, torchvision_model


@pytest.fixture
def one_thread():
    # on a shared, loaded CPU two intra-op threads mostly wait on each other (measured ~15x slower)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- ViT ----

@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28)], ids=lambda s: "x".join(map(str, s)))
def test_vit_maps_images_to_logits(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = ViT(num_classes=10, input_shape=shape, dim=48, depth=2, heads=3)
    logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, 10)
    assert model.pos_embed.shape[1] == (shape[1] // 4) * (shape[2] // 4) + 1  # patches + class token


def test_default_vit_size() -> None:
    model = ViT(num_classes=10)
    count = sum(p.numel() for p in model.parameters())
    print(f"vit default (3x32x32, patch 4, dim 192, depth 6): {count:,} parameters")
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 6
    assert 2_500_000 < count < 3_000_000


def test_tiny_vit_overfits_a_fixed_batch(one_thread: None) -> None:
    torch.manual_seed(0)
    model = ViT(num_classes=10, input_shape=(3, 16, 16), dim=32, depth=2, heads=2)
    images, labels = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(200):
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if losses[-1] < 0.1 * losses[0]:  # the property is reached: stop paying for CPU steps
            break
    print(f"vit tiny overfit: loss {losses[0]:.3f} -> {losses[-1]:.4f} in {len(losses)} steps")
    assert losses[-1] < 0.1 * losses[0]


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(patch_size=5), r"^patch_size: 5 does not divide the 32x32 image; allowed: 1, 2, 4, 8, 16, 32$"),
    (dict(dim=100, heads=3), r"^dim: 100 is not divisible by heads=3; allowed: a multiple of 3$"),
    (dict(input_shape=(64,)), r"^input_shape: \(64,\) is not an image; allowed: \(channels, height, width\)$"),
    (dict(depth=0), r"^depth: 0 is too small; allowed: an integer >= 1$"),
])
def test_vit_bad_values_raise_one_line_naming_the_parameter(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ViT(num_classes=10, **kwargs)


# ---- torchvision ----

@pytest.mark.parametrize("small_stem", [False, True])
def test_torchvision_resnet18_on_cifar_shaped_batches(small_stem: bool) -> None:
    torch.manual_seed(0)
    model = torchvision_model("resnet18", num_classes=10, input_shape=(3, 32, 32), small_stem=small_stem)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert isinstance(model.maxpool, nn.Identity) == small_stem
    assert model.conv1.kernel_size == ((3, 3) if small_stem else (7, 7))


def test_torchvision_first_conv_follows_input_channels() -> None:
    torch.manual_seed(0)
    model = torchvision_model("resnet18", num_classes=7, input_shape=(1, 32, 32))
    assert model.conv1.in_channels == 1 and model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 7)
    other = torchvision_model("mobilenet_v3_small", num_classes=7, input_shape=(1, 32, 32))
    assert other(torch.randn(2, 1, 32, 32)).shape == (2, 7)


def test_torchvision_kwargs_reach_the_constructor() -> None:
    model = torchvision_model("mobilenet_v3_small", num_classes=5, input_shape=(3, 32, 32), dropout=0.35)
    assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == [0.35]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_torchvision_local_weights_round_trip(tmp_path: Path, suffix: str) -> None:
    torch.manual_seed(0)
    source = torchvision_model("resnet18", num_classes=10, input_shape=(1, 32, 32), small_stem=True)
    path = tmp_path / f"resnet18{suffix}"
    if suffix == ".pt":
        torch.save(source.state_dict(), path)
    else:
        from safetensors.torch import save_file
        save_file(source.state_dict(), str(path))
    torch.manual_seed(1)  # a different random init, so equality can only come from the file
    loaded = torchvision_model("resnet18", num_classes=10, input_shape=(1, 32, 32), small_stem=True, weights=str(path))
    source_state, loaded_state = source.state_dict(), loaded.state_dict()
    assert source_state.keys() == loaded_state.keys()
    assert all(torch.equal(source_state[k], loaded_state[k]) for k in source_state)


def test_weights_that_do_not_fit_are_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ten.pt"
    torch.save(torchvision_model("resnet18", num_classes=10).state_dict(), path)
    with pytest.raises(ValueError, match=r"^weights: '.*ten.pt' does not fit this model: wrong shape \['fc.bias', "
                                         r"'fc.weight'\]$"):
        torchvision_model("resnet18", num_classes=3, weights=str(path))
    with pytest.raises(ValueError, match=r"^weights: '.*nothere.pt' is not a file; [^\n]*$"):
        torchvision_model("resnet18", num_classes=10, weights=str(tmp_path / "nothere.pt"))
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"^weights: '.*junk.pt' could not be read as a state dict [^\n]*$"):
        torchvision_model("resnet18", num_classes=10, weights=str(tmp_path / "junk.pt"))


def test_torchvision_unknown_name_lists_close_names() -> None:
    with pytest.raises(ValueError, match=r"^name: 'resnet181' is not a torchvision model; close names: resnet18"
                                         r"[^\n]*$"):
        torchvision_model("resnet181", num_classes=10)


def test_small_stem_is_only_for_resnets() -> None:
    with pytest.raises(ValueError, match=r"^small_stem: true is for ResNets, not 'mobilenet_v3_small'; "
                                         r"allowed: false$"):
        torchvision_model("mobilenet_v3_small", num_classes=10, small_stem=True)


# ---- timm ----

@pytest.mark.parametrize("channels", [3, 1])
def test_timm_resnet10t_on_small_images(channels: int) -> None:
    torch.manual_seed(0)
    model = timm_model("resnet10t", num_classes=10, input_shape=(channels, 32, 32))
    assert model(torch.randn(2, channels, 32, 32)).shape == (2, 10)


def test_timm_kwargs_and_local_weights_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = timm_model("vit_tiny_patch16_224", num_classes=10, input_shape=(3, 32, 32), img_size=32, depth=2)
    assert source(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    path = tmp_path / "vit.pt"
    torch.save(source.state_dict(), path)
    torch.manual_seed(1)
    loaded = timm_model("vit_tiny_patch16_224", num_classes=10, input_shape=(3, 32, 32), img_size=32, depth=2,
                        weights=str(path))
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), loaded.state_dict().values()))


def test_timm_unknown_name_lists_close_names() -> None:
    with pytest.raises(ValueError, match=r"^name: 'resnet10x' is not a timm model; close names: [^\n]*resnet10t"):
        timm_model("resnet10x", num_classes=10)


# ---- conf/model options naming these builders ----

DATA_DECIDED = {"num_classes", "input_shape", "vocab_size", "max_length", "pad_token_id"}


@pytest.mark.parametrize("option, data, batch", [
    ("gpt", dict(vocab_size=50, max_length=16), torch.randint(0, 50, (2, 16))),
    ("vit", dict(num_classes=10, input_shape=(3, 32, 32)), torch.randn(2, 3, 32, 32)),
    ("torchvision", dict(num_classes=10, input_shape=(3, 32, 32)), torch.randn(2, 3, 32, 32)),
    ("timm", dict(num_classes=10, input_shape=(3, 32, 32)), torch.randn(2, 3, 32, 32)),
])
def test_model_option_instantiates_with_what_the_data_decides(option: str, data: dict, batch: torch.Tensor) -> None:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    path = Path(__file__).parents[2] / "conf" / "model" / f"{option}.yaml"
    assert path.read_text().startswith("# "), "first line says what the option is"
    cfg = OmegaConf.load(path)
    assert not DATA_DECIDED & set(cfg), "data-decided values come from the data, not the YAML"
    model = instantiate(cfg, **data)
    out = model(batch)
    assert out.shape == ((2, 16, 50) if option == "gpt" else (2, 10))


@pytest.mark.parametrize("build, name, size_key", [
    pytest.param(torchvision_model, "vit_b_16", "image_size", marks=pytest.mark.slow),  # 86M parameters, twice
    (timm_model, "vit_tiny_patch16_224", "img_size")])
def test_an_architecture_made_for_another_image_size_is_refused_when_built(build, name: str, size_key: str) -> None:
    """Issue 26, section 2: torch's traceback at the first step before; one line naming the key and the size now."""
    with pytest.raises(ValueError, match=rf"^name: '{name}' cannot read this data's 3x32x32 images \(AssertionError: "
                                         rf".*\); allowed: a model for this size \(e.g. \+model.{size_key}=32 "):
        build(name, num_classes=10, input_shape=(3, 32, 32))
    model = build(name, num_classes=10, input_shape=(3, 32, 32), **{size_key: 32})  # what the line suggests
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10) and model.training
