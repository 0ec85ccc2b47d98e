"""The folds of k-fold cross-validation: train and val pooled, then cut into K parts by scikit-learn.

Fold k validates on part k and trains on the other K-1; the test split is never touched, so every fold
tests on the same samples. Classification folds are stratified (StratifiedKFold: each class's count in
a fold differs from its count in another fold by at most one), other tasks get plain KFold. Both
shuffle with the fold seed (trainer.cross_validation.seed), so the folds depend on the data and that
seed only, never on the run's seed, and a fold's run rebuilds the same fold in any process.

A fold's run is an ordinary run whose data is its fold's: the cut is part of building a run's data
(runner/engine/run_data.py); the K-fold run that plans the folds and runs them is
runner/search/cross_validation.py.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, Subset, TensorDataset

from runner.specs.fields import SpecError

KEY = "trainer.cross_validation.folds"


def fold_indices(labels: np.ndarray | None, size: int, folds: int, seed: int) -> list[np.ndarray]:
    """The validation indices (sorted) of each fold of range(size); stratified when labels are given."""
    from sklearn.model_selection import KFold, StratifiedKFold

    if stratifies(labels, folds):
        cut = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        return [np.sort(val) for _, val in cut.split(np.zeros(size), labels)]
    cut = KFold(n_splits=folds, shuffle=True, random_state=seed)
    return [np.sort(val) for _, val in cut.split(np.zeros(size))]


def pool_of(data: Any) -> tuple[Dataset, np.ndarray | None]:
    """Train followed by val as one dataset, and its class labels where folds are stratified by them.
    SpecError when the data cannot be folded."""
    train, val = data.train, data.val
    for name, split in (("train", train), ("val", val)):
        if isinstance(split, IterableDataset) or not hasattr(split, "__len__"):
            raise SpecError(f"{KEY}: the dataset's {name} split is a stream ({type(split).__name__}) with no "
                            "samples to assign to folds; k-fold needs map-style datasets (indexable, with a length)")
    if type(train) is not type(val) or getattr(train, "transform", None) is not getattr(val, "transform", None):
        # a sample moved from train to a fold's val would keep train's augmentation (and the reverse)
        raise SpecError(f"{KEY}: the dataset's train and val splits read samples differently ({_kind(train)} and "
                        f"{_kind(val)}: per-sample augmentation on train only), so pooling them would validate on "
                        "augmented samples; use the dataset without per-sample augmentation (batch mixup/cutmix is fine)")
    if len(val) == 0:
        raise SpecError(f"{KEY}: the dataset's val split is empty, so there is no train+val to fold; give the "
                        "dataset a validation split (dataset.val_fraction > 0 for the built-in ones)")
    if _tensors(train) and _tensors(val) and len(train.tensors) == len(val.tensors):
        pool: Dataset = TensorDataset(*(torch.cat(pair) for pair in zip(train.tensors, val.tensors)))
    else:
        pool = ConcatDataset([train, val])
    labels = _class_labels(pool) if getattr(data, "num_classes", None) is not None else None
    return pool, labels


def for_run(spec: Any, data: Any) -> Any:
    """The data a run trains on: its fold's when it is one fold of a k-fold run, else `data` itself."""
    cv = spec.trainer.cross_validation
    return data if cv.folds is None or cv.fold is None else fold_data(data, cv.folds, cv.fold, cv.seed)


def fold_data(data: Any, folds: int, fold: int, seed: int) -> Any:
    """`data` with train and val replaced by fold `fold`'s (test and everything else as they were)."""
    pool, labels = pool_of(data)
    check_size(len(pool), folds)
    val_idx = fold_indices(labels, len(pool), folds, seed)[fold]
    train_idx = np.setdiff1d(np.arange(len(pool)), val_idx)
    train, val = (_take(pool, idx) for idx in (train_idx, val_idx))
    if dataclasses.is_dataclass(data):
        return dataclasses.replace(data, train=train, val=val)
    out = copy.copy(data)
    out.train, out.val = train, val
    return out


def plan(data: Any, folds: int, seed: int) -> tuple[int, list[int], bool]:
    """What the folds of `data` will be, checked before any fold runs: the size of train+val, each fold's
    validation size, and whether the folds are stratified. SpecError when the data cannot be folded."""
    pool, labels = pool_of(data)
    check_size(len(pool), folds)
    parts = fold_indices(labels, len(pool), folds, seed)
    return len(pool), [len(part) for part in parts], stratifies(labels, folds)


def stratifies(labels: np.ndarray | None, folds: int) -> bool:
    """Whether folds keep the class proportions: every class needs a member in each fold (with fewer,
    sklearn refuses or warns, and plain folds are the honest answer)."""
    return labels is not None and int(np.unique(labels, return_counts=True)[1].min()) >= folds


def check_size(size: int, folds: int) -> None:
    if folds > size:
        raise SpecError(f"{KEY}: {folds} is more than the {size} samples of train+val; allowed: 2 to {size}")


def _kind(split: Dataset) -> str:
    transform = getattr(split, "transform", None)
    return type(split).__name__ + (f" with {type(transform).__name__}" if transform is not None else "")


def _tensors(split: Dataset) -> bool:
    return isinstance(split, TensorDataset)


def _take(pool: Dataset, idx: np.ndarray) -> Dataset:
    if isinstance(pool, TensorDataset):  # tensors stay tensors: the loader's whole-batch fast path stays
        index = torch.from_numpy(idx).long()
        return TensorDataset(*(t[index] for t in pool.tensors))
    return Subset(pool, idx.tolist())


def _class_labels(pool: Dataset) -> np.ndarray | None:
    """One integer class per sample, or None where samples have none (sequence or soft labels)."""
    if isinstance(pool, TensorDataset):
        labels = pool.tensors[-1]
    elif all(getattr(part, "targets", None) is not None for part in pool.datasets):  # torchvision's: no decoding
        labels = torch.cat([torch.as_tensor(part.targets) for part in pool.datasets])
    else:
        try:
            labels = torch.as_tensor([_label(pool[i]) for i in range(len(pool))])
        except (TypeError, ValueError, RuntimeError):  # labels of unequal shapes: no classes to stratify by
            return None
    if labels.dim() != 1 or labels.is_floating_point():
        return None
    return labels.numpy()


def _label(item: Any) -> Any:
    if isinstance(item, dict):
        return item.get("labels", item.get("label"))
    return item[-1]
