"""MNIST and Fashion-MNIST through torchvision: 28x28 grey images, 10 classes, official test set."""
from __future__ import annotations

from pathlib import Path

import torch

from runner.data.splits import DataSplits, from_train_test
from runner.spec import DatasetSpec, SpecError


def _load(kind_name: str, spec: DatasetSpec) -> DataSplits:
    # imported here: torchvision costs seconds to import, paid only by runs that use it
    from torchvision import datasets

    kind = getattr(datasets, kind_name)
    raw = Path(spec.root) / kind_name / "raw"
    try:
        train = kind(spec.root, train=True, download=spec.download)
        test = kind(spec.root, train=False, download=spec.download)
    except RuntimeError as error:  # torchvision's "Dataset not found" when download is false
        if spec.download:
            raise
        raise SpecError(f"dataset.download: {spec.name} not found in {raw.resolve()} (idx ubyte files); "
                        f"set dataset.download=true to fetch it") from error
    images = [d.data.unsqueeze(1) for d in (train, test)]  # uint8 (N, 1, 28, 28)
    labels = [torch.as_tensor(d.targets).long() for d in (train, test)]
    return from_train_test(images[0], labels[0], images[1], labels[1], spec, num_classes=10)


def build_mnist(spec: DatasetSpec) -> DataSplits:
    return _load("MNIST", spec)


def build_fashion_mnist(spec: DatasetSpec) -> DataSplits:
    return _load("FashionMNIST", spec)
