"""Dataset builders: one module per conf/dataset option, each `DatasetSpec -> DataSplits`.

Every split is an in-memory `TensorDataset` of standardized float32 inputs and int64 labels, so the
engine can index whole batches without per-sample Python work.
"""
from __future__ import annotations

from typing import Callable

from runner.data import cifar10, digits, mnist, synthetic
from runner.data.splits import DataSplits, split_indices
from runner.spec import DatasetSpec, SpecError

BUILDERS: dict[str, Callable[[DatasetSpec], DataSplits]] = {
    "digits": digits.build,
    "synthetic": synthetic.build,
    "mnist": mnist.build_mnist,
    "fashion_mnist": mnist.build_fashion_mnist,
    "cifar10": cifar10.build,
}

__all__ = ["BUILDERS", "DataSplits", "build_datasets", "split_indices"]


def build_datasets(spec: DatasetSpec) -> DataSplits:
    """Train, validation and test splits of the dataset `spec.name`, split deterministically by spec.split_seed."""
    builder = BUILDERS.get(spec.name)
    if builder is None:
        raise SpecError(f"dataset.name: no builder for {spec.name!r}; choose one of {', '.join(sorted(BUILDERS))}")
    return builder(spec)
