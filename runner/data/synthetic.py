"""Random inputs labelled by a fixed random linear teacher: any shape and size, learnable, no files."""
from __future__ import annotations

import math

import torch

from runner.data.splits import DataSplits, from_tensors
from runner.spec import DatasetSpec


def build(spec: DatasetSpec) -> DataSplits:
    generator = torch.Generator().manual_seed(spec.split_seed)
    x = torch.randn(spec.size, *spec.shape, generator=generator)
    teacher = torch.randn(math.prod(spec.shape), spec.num_classes, generator=generator)
    # labels are a function of the inputs, so a model can fit them and benchmark losses fall
    y = (x.flatten(1) @ teacher).argmax(1)
    # inputs are already zero-mean unit-variance by construction
    return from_tensors(x, y, spec, num_classes=spec.num_classes, standardize=False)
