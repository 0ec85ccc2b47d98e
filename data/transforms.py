"""Image augmentation from config, built on torchvision.transforms.v2.

`image_transforms` makes the per-sample transform of one split: train may augment (random crop,
horizontal flip, RandAugment or TrivialAugmentWide), evaluation only converts and normalises.
`batch_mixing` makes mixup/cutmix as a batch transform that turns integer labels into soft ones.

Randomness: every random transform here draws from torch's global CPU RNG, never from a generator
of its own. In the main process (num_workers=0) that RNG is the run's, seeded from the run seed and
saved and restored with checkpoints, so augmentation is reproducible and resumes exactly. In
DataLoader workers torch seeds each worker's global RNG from the loader's generator (base seed +
worker id), so the same loader seed gives the same augmented batches; but which sample gets which draw
then depends on the worker count, and a resumed run restarts the workers' streams from the base seed.
A loader that reads samples by (index, seed) keys (runner/data/images.py) removes both dependencies.
Mixup/cutmix run in the main process on the collated batch and so draw from the run's RNG.
"""
from __future__ import annotations

import math
from typing import Callable, Literal, Optional, Sequence

import torch
from torchvision.transforms import v2

AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment")
# RandAugment's magnitude is an index into its bins; torchvision's default is 31 bins (0..30)
RANDAUGMENT_BINS = 31


def image_transforms(train: bool, input_shape: Sequence[int], crop_padding: int = 0, hflip: bool = False,
                     auto_augment: Literal["none", "randaugment", "trivialaugment"] = "none",
                     randaugment_n: int = 2, randaugment_m: int = 9, mean: Optional[Sequence[float]] = None,
                     std: Optional[Sequence[float]] = None) -> v2.Compose:
    """The per-sample transform of a train (`train=True`) or evaluation split.

    Takes a uint8 image, a (C, H, W) tensor or a PIL image, of shape `input_shape`, and returns a plain
    float32 (C, H, W) tensor scaled to [0, 1] and, when `mean`/`std` are given, normalised per channel.
    Evaluation ignores every augmentation argument. All arguments are checked for both splits so that a
    bad value fails when the dataset is built, not halfway through training.

    The crop pads by reflection: zero padding would add a black frame, a colour no real border has, whose
    value after normalisation depends on the channel statistics; reflected pixels keep the border's own
    statistics. Reflection needs crop_padding < H and < W.
    """
    channels, height, width = _check(input_shape, crop_padding, auto_augment, randaugment_n, randaugment_m,
                                     mean, std)
    steps: list[Callable] = [v2.ToImage()]  # PIL images and plain tensors alike become tv_tensors.Image
    if train:
        if crop_padding > 0:
            steps.append(v2.RandomCrop((height, width), padding=crop_padding, padding_mode="reflect"))
        if hflip:
            steps.append(v2.RandomHorizontalFlip(p=0.5))
        # the auto-augment policies need uint8 pixels (posterize, solarize), so they run before ToDtype
        if auto_augment == "randaugment":
            steps.append(v2.RandAugment(num_ops=randaugment_n, magnitude=randaugment_m,
                                        num_magnitude_bins=RANDAUGMENT_BINS))
        elif auto_augment == "trivialaugment":
            steps.append(v2.TrivialAugmentWide())
    steps.append(v2.ToDtype(torch.float32, scale=True))
    if mean is not None:
        steps.append(v2.Normalize(list(mean), list(std)))  # type: ignore[arg-type]
    steps.append(v2.ToPureTensor())  # collation and models see plain tensors, not tv_tensors subclasses
    return v2.Compose(steps)


def _check(input_shape: Sequence[int], crop_padding: int, auto_augment: str, n: int, m: int,
           mean: Optional[Sequence[float]], std: Optional[Sequence[float]]) -> tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ValueError(f"input_shape: {tuple(input_shape)} is not an image shape; allowed: (C, H, W), all >= 1")
    channels, height, width = (int(d) for d in input_shape)
    if crop_padding < 0 or crop_padding >= min(height, width):
        raise ValueError(f"crop_padding: {crop_padding} does not fit {height}x{width} images (reflection padding); "
                         f"allowed: 0 <= crop_padding < {min(height, width)}")
    if auto_augment not in AUTO_AUGMENTS:
        raise ValueError(f"auto_augment: {auto_augment!r} is unknown; allowed: {', '.join(AUTO_AUGMENTS)}")
    if n < 1:
        raise ValueError(f"randaugment_n: {n} is too small; allowed: an integer >= 1")
    if not 0 <= m < RANDAUGMENT_BINS:
        raise ValueError(f"randaugment_m: {m} is out of range; allowed: 0 <= randaugment_m <= {RANDAUGMENT_BINS - 1}")
    if (mean is None) != (std is None):
        raise ValueError("mean: mean and std go together; allowed: both lists or both null")
    if mean is not None and std is not None:
        for name, values in (("mean", mean), ("std", std)):
            if len(values) != channels or not all(math.isfinite(v) for v in values):
                raise ValueError(f"{name}: {list(values)} does not fit {channels}-channel images; "
                                 f"allowed: {channels} finite numbers")
        if min(std) <= 0:
            raise ValueError(f"std: {list(std)} has a value <= 0; allowed: positive numbers")
    return channels, height, width


class BatchMixing:
    """Mixup and/or cutmix on a collated batch: `(x [B, ...], y [B] int64) -> (x_mixed, y_soft [B, K])`.

    With both on, each batch gets one of the two, chosen with equal probability. The soft labels are
    float32 and each row sums to 1. Randomness comes from torch's global RNG (see the module docstring).
    """

    def __init__(self, num_classes: int, mixup_alpha: float, cutmix_alpha: float):
        choices: list[Callable] = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        self.mix = choices[0] if len(choices) == 1 else v2.RandomChoice(choices)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mix(x, y)

    def __repr__(self) -> str:
        return f"BatchMixing({self.mix!r})"


def batch_mixing(num_classes: int, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0) -> Optional[Callable[[torch.Tensor, torch.Tensor],
                                                                 tuple[torch.Tensor, torch.Tensor]]]:
    """The train-only batch transform for DataSplits.batch_transform, or None when both alphas are 0."""
    for name, alpha in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"{name}: {alpha} is not allowed; allowed: a finite number >= 0 (0 turns it off)")
    if mixup_alpha == 0 and cutmix_alpha == 0:
        return None
    if num_classes < 2:
        raise ValueError(f"num_classes: {num_classes} is too few for mixup/cutmix; allowed: >= 2")
    return BatchMixing(num_classes, mixup_alpha, cutmix_alpha)
