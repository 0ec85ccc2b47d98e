"""MNIST and Fashion-MNIST through torchvision: 28x28 grey images, 10 classes, official test set."""
from __future__ import annotations

from pathlib import Path

import torch

from runner.data.splits import DataSplits, from_train_test


def _load(kind_name: str, name: str, root: str, download: bool, val_fraction: float, split_seed: int) -> DataSplits:
    # imported here: torchvision costs seconds to import, paid only by runs that use it
    from torchvision import datasets

    kind = getattr(datasets, kind_name)
    raw = Path(root) / kind_name / "raw"
    try:
        train = kind(root, train=True, download=download)
        test = kind(root, train=False, download=download)
    except RuntimeError as error:  # torchvision's "Dataset not found" when download is false
        if download:
            raise
        raise ValueError(f"root: {name} not found in {raw.resolve()} (idx ubyte files); set download=true to fetch "
                         f"it, or root=<the folder holding {kind_name}/raw>") from error
    images = [d.data.unsqueeze(1) for d in (train, test)]  # uint8 (N, 1, 28, 28)
    labels = [torch.as_tensor(d.targets).long() for d in (train, test)]
    return from_train_test(images[0], labels[0], images[1], labels[1], num_classes=10, val_fraction=val_fraction,
                           split_seed=split_seed)


def build_mnist(root: str = "datasets", download: bool = False, val_fraction: float = 0.1, split_seed: int = 0) -> DataSplits:
    return _load("MNIST", "mnist", root, download, val_fraction, split_seed)


def build_fashion_mnist(root: str = "datasets", download: bool = False, val_fraction: float = 0.1,
                        split_seed: int = 0) -> DataSplits:
    return _load("FashionMNIST", "fashion_mnist", root, download, val_fraction, split_seed)
