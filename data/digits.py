"""scikit-learn's 8x8 handwritten digits: 1797 images, 10 classes, shipped inside scikit-learn (offline)."""
from __future__ import annotations

import torch
from sklearn.datasets import load_digits

from runner.data.splits import DataSplits, from_tensors


def build(val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0) -> DataSplits:
    digits = load_digits()
    x = torch.from_numpy(digits.images).float().unsqueeze(1)  # (1797, 1, 8, 8), pixels 0..16
    y = torch.from_numpy(digits.target).long()
    return from_tensors(x, y, num_classes=10, val_fraction=val_fraction, test_fraction=test_fraction,
                        split_seed=split_seed)
