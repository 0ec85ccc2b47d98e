"""CIFAR-10: 32x32 colour images, 10 classes, read from the python-pickle batches, official test set."""
from __future__ import annotations

from pathlib import Path

from runner.data.cifar import FOLDER, TEST_FILES, TRAIN_FILES, read_batches
from runner.data.splits import DataSplits, from_train_test
from runner.spec import SpecError


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
    x_train, y_train = read_batches(folder, TRAIN_FILES)
    x_test, y_test = read_batches(folder, TEST_FILES)
    return from_train_test(x_train, y_train, x_test, y_test, num_classes=10, val_fraction=val_fraction,
                           split_seed=split_seed)
