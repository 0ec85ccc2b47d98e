"""Any torchvision or timm architecture by name: randomly initialised, or from a local weights file.

Weights never come from a hub here (runs are offline and reproducible); `weights` is a file path.
torchvision and timm are imported inside the functions: each costs seconds to import, paid only by
runs that use it.
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Iterable, Optional

import torch
from torch import nn


def torchvision_model(
    name: str,
    num_classes: int,
    input_shape: tuple[int, ...] = (3, 224, 224),
    weights: Optional[str] = None,
    small_stem: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """torchvision.models.get_model(name) with num_classes outputs, adapted to input_shape's channels.

    small_stem (ResNets, for 32x32 and smaller): a 3x3 stride-1 first conv and no max-pool, since the
    7x7 stride-2 conv plus max-pool would shrink a 32x32 image to 8x8 before the first stage.
    kwargs go to the model's constructor (e.g. image_size=32 for vit_b_16, dropout=0.2).
    """
    import torchvision

    known = torchvision.models.list_models()
    if name.lower() not in known:
        raise ValueError(f"name: {name!r} is not a torchvision model; {_close(name, known)}")
    _check_common(num_classes, input_shape)
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    channels = input_shape[0]
    if small_stem:
        if not isinstance(model, torchvision.models.ResNet):
            raise ValueError(f"small_stem: true is for ResNets, not {name!r}; allowed: false")
        model.conv1 = _small_stem_conv(channels, model.conv1.out_channels)
        model.maxpool = nn.Identity()
    elif channels != 3:
        _adapt_first_conv(model, channels, name)
    if weights is not None:
        _load_weights(model, weights)
    _check_reads(model, name, input_shape, "image_size")
    return model


def _small_stem_conv(channels: int, out_channels: int = 64) -> nn.Conv2d:
    """A ResNet's CIFAR-style first conv: 3x3, stride 1, no bias, initialised as torchvision inits its convs."""
    conv = nn.Conv2d(channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return conv


def timm_model(
    name: str,
    num_classes: int,
    input_shape: tuple[int, ...] = (3, 224, 224),
    weights: Optional[str] = None,
    **kwargs: Any,
) -> nn.Module:
    """timm.create_model(name, pretrained=False) with num_classes outputs and input_shape's channels.

    kwargs go to timm (e.g. img_size=32 for ViTs, drop_rate=0.1, drop_path_rate=0.1).
    """
    import timm

    # timm accepts "arch.pretrained_tag"; the tag only selects hub weights, which are never fetched here
    if not timm.is_model(name.split(".")[0]):
        raise ValueError(f"name: {name!r} is not a timm model; {_close(name, timm.list_models())}")
    _check_common(num_classes, input_shape)
    model = timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=input_shape[0], **kwargs)
    if weights is not None:
        _load_weights(model, weights)
    _check_reads(model, name, input_shape, "img_size")
    return model


def _check_reads(model: nn.Module, name: str, input_shape: tuple[int, ...], size_key: str) -> None:
    """One sample of the data's size through the model: an architecture made for another image size (a ViT's
    fixed 224x224 patch grid) fails here in one line, not in torch's traceback at the first step. In eval mode
    and without gradients, so the model's state (BatchNorm's statistics) and the RNG are left as they were."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    except (AssertionError, RuntimeError, ValueError, TypeError, IndexError) as error:
        first = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"name: {name!r} cannot read this data's {'x'.join(map(str, input_shape))} images "
                         f"({type(error).__name__}: {first[:200]}); allowed: a model for this size (e.g. "
                         f"+model.{size_key}={input_shape[-1]} where the architecture takes it), or data resized "
                         "to what it reads") from None
    finally:
        model.train(was_training)


def _check_common(num_classes: int, input_shape: tuple[int, ...]) -> None:
    if num_classes < 1:
        raise ValueError(f"num_classes: {num_classes} is too small; allowed: an integer >= 1")
    if len(input_shape) != 3:
        raise ValueError(f"input_shape: {tuple(input_shape)} is not an image; allowed: (channels, height, width)")


def _close(name: str, known: Iterable[str]) -> str:
    matches = difflib.get_close_matches(name.lower(), list(known), n=5, cutoff=0.5)
    return f"close names: {', '.join(matches)}" if matches else "no close names (see list_models())"


def _adapt_first_conv(model: nn.Module, channels: int, name: str) -> None:
    """Swap the first 3-channel conv for one taking `channels`, keeping its shape and init scale."""
    for path, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and module.in_channels == 3:
            conv = nn.Conv2d(channels, module.out_channels, module.kernel_size, stride=module.stride,
                             padding=module.padding, dilation=module.dilation, groups=module.groups,
                             bias=module.bias is not None, padding_mode=module.padding_mode)
            # each architecture inits its stem its own way; drawing at the old weights' scale keeps
            # that scale without knowing the scheme
            with torch.no_grad():
                conv.weight.normal_(0.0, module.weight.std().item())
                if conv.bias is not None:
                    conv.bias.copy_(module.bias)
            parent_path, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent_path), attr, conv)
            return
    raise ValueError(f"input_shape: {channels} channels, but {name!r} has no 3-channel conv to adapt; allowed: 3")


def _load_weights(model: nn.Module, path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"weights: {path!r} is not a file; allowed: a local state-dict file (.pt/.pth/.safetensors)")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(f"weights: {path!r} is .safetensors but the safetensors package is not installed; "
                             f"allowed: a torch.save'd state dict, or pip install safetensors") from None
        state = load_file(path, device="cpu")
    else:
        try:
            # weights_only: a weights file is data; unpickling arbitrary objects from it could run code
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a corrupt or non-torch file: say which, in one line
            raise ValueError(f"weights: {path!r} could not be read as a state dict "
                             f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"weights: {path!r} does not hold a state dict (name -> tensor); "
                         f"allowed: the file torch.save(model.state_dict(), path) writes")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        # strict: a silently half-loaded model trains, but not from the weights the user named
        found = (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        problems = [f"{label} {keys[:3]}{' ...' if len(keys) > 3 else ''}" for label, keys in found if keys]
        raise ValueError(f"weights: {path!r} does not fit this model: {'; '.join(problems)}")
    model.load_state_dict(state)
