"""CIFAR-10: 32x32 colour images, 10 classes, read from the python-pickle batches, official test set.

The plain variant: every split standardised once by the training split's statistics, no augmentation
(data/cifar.py reads the same files for the augmented recipe)."""
from __future__ import annotations

from runner.data.cifar import load
from runner.data.splits import DataSplits, from_train_test


def build(root: str = "datasets", download: bool = False, val_fraction: float = 0.1, split_seed: int = 0) -> DataSplits:
    x_train, y_train, x_test, y_test = load(root, download)
    return from_train_test(x_train, y_train, x_test, y_test, num_classes=10, val_fraction=val_fraction,
                           split_seed=split_seed)
