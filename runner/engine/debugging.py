"""What the debug presets (conf/debug/) switch on: smaller splits, overfitting a few batches (the goal is an
add-on: runner/addons/overfit_goal.py), autograd anomaly detection. The keys are the trainer's
(runner/specs/debug.py); the engine calls these in a few hooks.

Limits take each split's first samples, before the loader deals them to ranks: every rank, every
world size and a resumed run then see the same subset, and the loader's order stays a function of
(seed, epoch) alone.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, TensorDataset

from runner.engine.monitor import Diverged
from runner.specs.run import RunSpec


class Head(Dataset):
    """The first `size` items of a map-style dataset. The loader only asks for indices below `size`,
    so an index (or an (index, seed) key) passes through unchanged."""

    def __init__(self, dataset: Dataset, size: int):
        self.dataset, self.size = dataset, size
        self.takes_sample_seeds = bool(getattr(dataset, "takes_sample_seeds", False))
        if hasattr(dataset, "__getitems__"):
            self.__getitems__ = dataset.__getitems__

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]


def head(dataset: Dataset, size: int) -> Dataset:
    if size >= len(dataset):
        return dataset
    if isinstance(dataset, TensorDataset):  # views of the tensors: the whole-batch gather fast path stays
        return TensorDataset(*(t[:size] for t in dataset.tensors))
    return Head(dataset, size)


class LimitedData:
    """The dataset builder's result with smaller splits; everything else (num_classes, collate, ...) is its own."""

    def __init__(self, data: Any, splits: dict[str, Dataset]):
        self._data, self._splits = data, splits

    def __getattr__(self, name: str) -> Any:
        splits = self.__dict__.get("_splits", {})
        return splits[name] if name in splits else getattr(self.__dict__["_data"], name)


def split_limits(spec: RunSpec, sizes: dict[str, int], dp_degree: int) -> dict[str, int]:
    """How many of each split's first samples the run uses."""
    t = spec.trainer
    global_batch = spec.dataset.batch_size * dp_degree
    limits = {}
    for split, fraction in (("train", t.limit_train), ("val", t.limit_val), ("test", t.limit_test)):
        size = sizes[split]
        # at least one sample of a split that has any: a fraction never empties a split
        n = min(size, max(1, math.floor(fraction * size + 1e-9))) if size else 0
        if split == "train" and t.overfit_batches:
            n = min(n, t.overfit_batches * global_batch)
        if split != "train" and t.max_eval_batches is not None:
            n = min(n, t.max_eval_batches * global_batch)
        limits[split] = n
    return limits


def limit_data(spec: RunSpec, data: Any, dp_degree: int) -> Any:
    sizes = {split: len(getattr(data, split)) for split in ("train", "val", "test")}
    limits = split_limits(spec, sizes, dp_degree)
    if limits == sizes:
        return data
    return LimitedData(data, {split: head(getattr(data, split), limits[split]) for split in limits})


@contextlib.contextmanager
def anomaly_detection(spec: RunSpec, step: Callable[[], int]) -> Iterator[None]:
    """trainer.detect_anomaly: autograd checks every backward function's output; its error (a NaN made
    in the backward) becomes one line naming the optimizer step it happened in."""
    if not spec.trainer.detect_anomaly:
        yield
        return
    with torch.autograd.set_detect_anomaly(True):
        try:
            yield
        except RuntimeError as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "nan" not in text.lower():
                raise
            raise Diverged(f"step {step() + 1}: autograd anomaly detection: {text} (the forward call that "
                           f"made it is in the warning above)") from None
