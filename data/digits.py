"""scikit-learn's 8x8 handwritten digits: 1797 images, 10 classes, shipped inside scikit-learn (offline)."""
from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch

from runner.data.splits import DataSplits, from_tensors


def build(val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0) -> DataSplits:
    images, target = load_digits()
    x = torch.from_numpy(images).float().unsqueeze(1)  # (1797, 1, 8, 8), pixels 0..16
    y = torch.from_numpy(target).long()
    return from_tensors(x, y, num_classes=10, val_fraction=val_fraction, test_fraction=test_fraction,
                        split_seed=split_seed)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images (1797, 8, 8) and labels of sklearn.datasets.load_digits, read from the file scikit-learn
    ships as that function reads it, without importing scikit-learn (over a second of start-up)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("dataset=digits reads the digits scikit-learn ships: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, mode="rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)
