"""CIFAR-10: 32x32 colour images, 10 classes, read from the python-pickle batches, official test set."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from runner.data.splits import DataSplits, from_train_test
from runner.spec import SpecError

FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)


def build(root: str = "datasets", download: bool = False, val_fraction: float = 0.1, split_seed: int = 0) -> DataSplits:
    folder = Path(root) / FOLDER
    if download:
        from torchvision import datasets  # here: torchvision costs seconds to import

        datasets.CIFAR10(root, train=True, download=True)  # fetches and checks the archive once
    missing = [name for name in TRAIN_FILES + TEST_FILES if not (folder / name).is_file()]
    if missing:
        raise SpecError(f"dataset.download: cifar10 not found in {folder.resolve()} (missing {', '.join(missing)}); "
                        f"set dataset.download=true to fetch it")
    # read the batches directly: torchvision's loader insists on the md5 of the official files
    x_train, y_train = _read(folder, TRAIN_FILES)
    x_test, y_test = _read(folder, TEST_FILES)
    return from_train_test(x_train, y_train, x_test, y_test, num_classes=10, val_fraction=val_fraction,
                           split_seed=split_seed)


def _read(folder: Path, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = [], []
    for name in names:
        with open(folder / name, "rb") as f:
            batch = pickle.load(f, encoding="latin1")  # the official batches are Python 2 pickles
        images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch["labels"], dtype=np.int64))
    return torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels))
