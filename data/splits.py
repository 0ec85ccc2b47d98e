"""What every dataset builder returns, and the deterministic train/val/test carving they share."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


@dataclass(frozen=True)
class DataSplits:
    """What a dataset builder returns: three splits (any may be empty) and what the data decides for
    the model (passed to it only through the constructor parameters of the same names).

    Items are `(inputs, label)` tuples or dicts (`input_ids`, `attention_mask`, `labels`); labels that
    must not count (padding) are -100. `collate` batches items (default: torch's); `batch_transform`
    (train only) maps a batch on the device, e.g. mixup/cutmix to soft labels.
    """

    train: Dataset
    val: Dataset
    test: Dataset
    input_shape: tuple[int, ...] = ()
    num_classes: Optional[int] = None
    vocab_size: Optional[int] = None
    pad_token_id: Optional[int] = None
    max_length: Optional[int] = None
    collate: Optional[Callable] = None
    batch_transform: Optional[Callable] = None
    tokenizer: Optional[Any] = None  # the `tokenizers.Tokenizer` that made the ids, for a model to check its own against
    # mode=predict on a text file: new texts as a dataset, encoded as this data encodes its own (labels 0)
    encode_texts: Optional[Callable[[list[str]], Dataset]] = None


@dataclass(frozen=True)
class TokenSplits(DataSplits):
    """DataSplits of token id sequences (`vocab_size` set). A builder annotated `-> TokenSplits` says so
    before it runs, so a model that cannot read token ids is refused before minutes of tokenizing."""

    gives_token_ids: ClassVar[bool] = True  # what runner reads from the return annotation

    def __post_init__(self) -> None:
        if self.vocab_size is None:
            raise ValueError("vocab_size: TokenSplits needs the vocabulary size of its token ids")


def split_indices(labels: torch.Tensor, val_fraction: float, test_fraction: float,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Disjoint sorted train/val/test indices covering range(len(labels)), stratified where possible.

    Both fractions are shares of the whole set; the same labels, fractions and seed give the same split
    on every machine, independent of the run seed.
    """
    y = labels.numpy()
    # the 1e-9 keeps float noise (0.7 * 100 = 70.00000000000001) from taking one sample too many
    n_test, n_val = (math.ceil(f * len(y) - 1e-9) for f in (test_fraction, val_fraction))
    if n_test + n_val >= len(y):
        raise ValueError(f"val_fraction: val_fraction {val_fraction:g} + test_fraction {test_fraction:g} "
                        f"leave no training samples out of {len(y)}; lower them or use more data")
    rest, test = _carve(np.arange(len(y)), y, n_test, seed)
    train, val = _carve(rest, y[rest], n_val, seed)
    return tuple(torch.from_numpy(np.sort(part)).long() for part in (train, val, test))  # type: ignore[return-value]


def _carve(idx: np.ndarray, y: np.ndarray, n_out: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`idx` split into kept and `n_out` carved-out indices: scikit-learn's train_test_split(idx,
    test_size=n_out, random_state=seed, stratify=y where it can), index for index, without importing
    scikit-learn (over a second of start-up); tests/data/test_splits.py compares the two."""
    if n_out == 0:
        return idx, idx[:0]
    rng = np.random.RandomState(seed % 2**32)
    classes, y_codes, counts = np.unique(y, return_inverse=True, return_counts=True)
    # sklearn cannot stratify when a class has one member or a side is smaller than the class count
    if counts.min() >= 2 and min(n_out, len(idx) - n_out) >= len(counts):
        keep, out = _stratified(y_codes.reshape(-1), counts, len(idx) - n_out, n_out, rng)
    else:  # ShuffleSplit's: one permutation, the carved-out share first
        order = rng.permutation(len(idx))
        keep, out = order[n_out:], order[:n_out]
    return idx[keep], idx[out]


def _stratified(y_codes: np.ndarray, counts: np.ndarray, n_keep: int, n_out: int,
                rng: np.random.RandomState) -> tuple[np.ndarray, np.ndarray]:
    """StratifiedShuffleSplit's first split (scikit-learn 1.x), drawing from `rng` in the same order."""
    by_class = np.split(np.argsort(y_codes, kind="stable"), np.cumsum(counts)[:-1])
    keep_per_class = _approximate_mode(counts, n_keep, rng)
    out_per_class = _approximate_mode(counts - keep_per_class, n_out, rng)
    keep: list = []
    out: list = []
    for members, n_k, n_o in zip(by_class, keep_per_class, out_per_class):
        shuffled = members.take(rng.permutation(len(members)), mode="clip")
        keep.extend(shuffled[:n_k])
        out.extend(shuffled[n_k:n_k + n_o])
    return rng.permutation(keep), rng.permutation(out)


def _approximate_mode(counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `n_draws` each class gets: floors of the proportional shares, the rest to the largest
    remainders, ties broken at random (sklearn.utils.extmath._approximate_mode)."""
    continuous = counts / counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        # return_counts: np.unique without it imports numpy.ma (a tenth of a second) to check for a mask
        for value in np.unique(remainder, return_counts=True)[0][::-1]:
            (tied,) = np.where(remainder == value)
            add_now = min(len(tied), need_to_add)
            floored[rng.choice(tied, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def standardizer(train_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of the training inputs, shaped to broadcast over (N, C, ...)."""
    channels = train_x.shape[1]
    total = torch.zeros(channels, dtype=torch.float64)
    squares = torch.zeros(channels, dtype=torch.float64)
    # float64 for exact sums, in chunks so a uint8 image set is never held as float64 all at once
    for chunk in train_x.split(4096):
        flat = chunk.double().transpose(0, 1).reshape(channels, -1)
        total += flat.sum(1)
        squares += flat.square().sum(1)
    count = train_x.numel() / channels
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(0).sqrt().clamp_min(1e-8)
    shape = (1, channels) + (1,) * (train_x.dim() - 2)
    return mean.float().view(shape), std.float().view(shape)


def _tensors(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, mean: torch.Tensor | None,
             std: torch.Tensor | None) -> TensorDataset:
    part = x[idx].float()  # converting per split keeps one float copy of the data, not two
    if mean is not None:
        part.sub_(mean).div_(std)  # in place: indexing already made part a copy
    return TensorDataset(part.contiguous(), y[idx].long())


def from_tensors(x: torch.Tensor, y: torch.Tensor, num_classes: int, *, val_fraction: float, test_fraction: float,
                 split_seed: int, standardize: bool = True) -> DataSplits:
    """Split one pool of samples three ways by the fractions; standardize with train statistics only."""
    train, val, test = split_indices(y, val_fraction, test_fraction, split_seed)
    mean, std = standardizer(x[train]) if standardize else (None, None)
    return DataSplits(*(_tensors(x, y, idx, mean, std) for idx in (train, val, test)),
                      input_shape=tuple(x.shape[1:]), num_classes=num_classes)


def from_train_test(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                    num_classes: int, *, val_fraction: float, split_seed: int) -> DataSplits:
    """Keep the official test set; carve validation from train by val_fraction."""
    train, val, _ = split_indices(y_train, val_fraction, 0.0, split_seed)
    mean, std = standardizer(x_train[train])
    every = torch.arange(len(y_test))
    return DataSplits(_tensors(x_train, y_train, train, mean, std), _tensors(x_train, y_train, val, mean, std),
                      _tensors(x_test, y_test, every, mean, std),
                      input_shape=tuple(x_train.shape[1:]), num_classes=num_classes)
