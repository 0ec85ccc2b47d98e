"""Random inputs labelled by a fixed random linear teacher: any shape and size, learnable, no files."""
from __future__ import annotations

import math

import torch

from torch.utils.data import TensorDataset

from runner.data.splits import DataSplits, TokenSplits, from_tensors

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


def tokens(vocab_size: int = 50304, block_size: int = 1024, size: int = 512, val_fraction: float = 0.05,
           test_fraction: float = 0.05, split_seed: int = 0) -> TokenSplits:
    """Uniformly random token ids in blocks of `block_size` (labels: the next ids): a language model's
    data shape and nothing to learn, for throughput benchmarks at any vocabulary and context length."""
    for name, value, low in (("vocab_size", vocab_size, 2), ("block_size", block_size, 1), ("size", size, 3)):
        if not low <= value <= DIM:
            raise ValueError(f"{name}: {value} is out of range; allowed: an integer >= {low}")
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(f"val_fraction: {val_fraction:g} + test_fraction {test_fraction:g} leave no training "
                         "blocks; allowed: each in [0, 1), their sum below 1")
    ids = torch.randint(vocab_size, (size, block_size + 1), generator=torch.Generator().manual_seed(split_seed))
    n_test, n_val = (math.ceil(f * size) for f in (test_fraction, val_fraction))
    bounds = (0, size - n_val - n_test, size - n_test, size)
    splits = [TensorDataset(ids[a:b, :-1].contiguous(), ids[a:b, 1:].contiguous()) for a, b in zip(bounds, bounds[1:])]
    return TokenSplits(*splits, vocab_size=vocab_size, max_length=block_size)
