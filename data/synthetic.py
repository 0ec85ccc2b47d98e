"""Random inputs labelled by a fixed random linear teacher: any shape and size, learnable, no files."""
from __future__ import annotations

import math

import torch

from runner.data.splits import DataSplits, from_tensors

DIM = 2**31 - 1


def build(shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10, size: int = 2048, val_fraction: float = 0.15,
          test_fraction: float = 0.15, split_seed: int = 0) -> DataSplits:
    if not shape or any(not 0 < d <= DIM for d in shape):
        raise ValueError(f"shape: {list(shape)} is not allowed; every size must be > 0")
    if not 1 < num_classes <= DIM:
        raise ValueError(f"num_classes: {num_classes} is out of range; allowed: a value > 1")
    if not 0 < size <= DIM:
        raise ValueError(f"size: {size} is out of range; allowed: a value > 0")
    generator = torch.Generator().manual_seed(split_seed)
    x = torch.randn(size, *shape, generator=generator)
    teacher = torch.randn(math.prod(shape), num_classes, generator=generator)
    # labels are a function of the inputs, so a model can fit them and benchmark losses fall
    y = (x.flatten(1) @ teacher).argmax(1)
    # inputs are already zero-mean unit-variance by construction
    return from_tensors(x, y, num_classes=num_classes, val_fraction=val_fraction, test_fraction=test_fraction,
                        split_seed=split_seed, standardize=False)
