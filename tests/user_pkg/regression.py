"""A user's regression data: noisy linear targets, two outputs per sample."""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from runner.data.splits import DataSplits


def build(size: int = 200, features: int = 6, outputs: int = 2, seed: int = 0) -> DataSplits:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, features, generator=g)
    y = x @ torch.randn(features, outputs, generator=g) + 0.1 * torch.randn(size, outputs, generator=g)
    cut = [int(size * 0.7), int(size * 0.85)]
    parts = [TensorDataset(x[a:b], y[a:b]) for a, b in ((0, cut[0]), (cut[0], cut[1]), (cut[1], size))]
    return DataSplits(*parts, input_shape=(features,), num_classes=outputs)
