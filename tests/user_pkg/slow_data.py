"""A user's dataset whose samples are slow to make (each __getitem__ sleeps, as decoding a large image
would): a run on it with dataset.num_workers=0 is bound by data loading (the profiler's advice test)."""
from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

from runner.data.splits import DataSplits


class SlowSamples(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, seconds: float):
        self.x, self.y, self.seconds = x, y, seconds

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return self.x[i], self.y[i]


def build(sizes: tuple[int, int, int] = (64, 8, 8), features: int = 4, classes: int = 2,
          seconds_per_sample: float = 0.002, seed: int = 0) -> DataSplits:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), features, generator=g)
    y = (x[:, 0] > 0).long()
    a, b = sizes[0], sizes[0] + sizes[1]
    parts = [SlowSamples(x[i:j], y[i:j], seconds_per_sample) for i, j in ((0, a), (a, b), (b, len(y)))]
    return DataSplits(*parts, input_shape=(features,), num_classes=classes)
