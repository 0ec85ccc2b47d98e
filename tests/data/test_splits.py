"""runner/data/splits.py carves splits without scikit-learn, index for index as its train_test_split did,
and runner/data/digits.py reads the digits scikit-learn ships without importing it (start-up: issue 25)."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from runner.data import split_indices
from runner.data.splits import _carve


def sklearn_carve(idx: np.ndarray, y: np.ndarray, n_out: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The carving as it was (data/splits.py before issue 25): scikit-learn's own train_test_split."""
    from sklearn.model_selection import train_test_split

    if n_out == 0:
        return idx, idx[:0]
    counts = np.unique(y, return_counts=True)[1]
    can_stratify = counts.min() >= 2 and min(n_out, len(idx) - n_out) >= len(counts)
    keep, out = train_test_split(idx, test_size=n_out, random_state=seed % 2**32, stratify=y if can_stratify else None)
    return keep, out


def sklearn_split_indices(labels: torch.Tensor, val_fraction: float, test_fraction: float, seed: int):
    y = labels.numpy()
    n_test, n_val = (math.ceil(f * len(y) - 1e-9) for f in (test_fraction, val_fraction))
    rest, test = sklearn_carve(np.arange(len(y)), y, n_test, seed)
    train, val = sklearn_carve(rest, y[rest], n_val, seed)
    return tuple(torch.from_numpy(np.sort(part)).long() for part in (train, val, test))


def _digits_labels() -> torch.Tensor:
    from sklearn.datasets import load_digits

    return torch.from_numpy(load_digits().target)


LABELS = {
    "digits": _digits_labels,
    "balanced 4 classes": lambda: torch.arange(400) % 4,
    # unequal classes: the largest-remainder ties are broken by the random stream
    "skewed 3 classes": lambda: torch.tensor([0] * 50 + [1] * 17 + [2] * 6),
    "a class of one (not stratifiable)": lambda: torch.tensor([0] * 30 + [1] * 29 + [2]),
    "more classes than a side (not stratifiable)": lambda: torch.arange(40) % 20,
    "one class": lambda: torch.zeros(25, dtype=torch.long),
    "random 10 classes": lambda: torch.randint(0, 10, (1000,), generator=torch.Generator().manual_seed(3)),
    "unsorted labels not from 0": lambda: torch.tensor([7, 3, 3, 9, 7, 9, 3, 7, 9, 9, 3, 7] * 5),
}


@pytest.mark.parametrize("name", list(LABELS))
@pytest.mark.parametrize("val_fraction,test_fraction", [(0.15, 0.15), (0.1, 0.0), (0.0, 0.2), (0.3, 0.25), (0.05, 0.5)])
@pytest.mark.parametrize("seed", [0, 1, 1234, 2**32 + 5])
def test_split_indices_equal_scikit_learns(name: str, val_fraction: float, test_fraction: float, seed: int) -> None:
    labels = LABELS[name]()
    ours = split_indices(labels, val_fraction, test_fraction, seed)
    theirs = sklearn_split_indices(labels, val_fraction, test_fraction, seed)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


@pytest.mark.parametrize("n_out", [1, 5, 17, 59])
def test_one_carving_keeps_scikit_learns_order_too(n_out: int) -> None:
    """Not only the same sets: the same order of the kept and carved-out indices (before they are sorted)."""
    y = np.array([0] * 30 + [1] * 20 + [2] * 10)
    idx = np.arange(100, 160)
    for seed in (0, 7):
        for a, b in zip(_carve(idx, y, n_out, seed), sklearn_carve(idx, y, n_out, seed)):
            assert np.array_equal(a, b)


def test_the_data_modules_splits_are_the_ones_scikit_learn_made() -> None:
    """The digits and synthetic options (offline) split as before: the labels of each split are those
    of scikit-learn's indices."""
    from tests.data.test_datasets import build_datasets

    digits = build_datasets()
    labels = _digits_labels()
    for idx, part in zip(sklearn_split_indices(labels, 0.15, 0.15, 0), (digits.train, digits.val, digits.test)):
        assert torch.equal(part.tensors[1], labels[idx])
    synthetic = build_datasets("synthetic", shape=(4,), num_classes=5, size=300, split_seed=3)
    every_y = torch.cat([synthetic.train.tensors[1], synthetic.val.tensors[1], synthetic.test.tensors[1]])
    generator = torch.Generator().manual_seed(3)  # data/synthetic.py's draw, to know every label's index
    x = torch.randn(300, 4, generator=generator)
    y = (x @ torch.randn(4, 5, generator=generator)).argmax(1)
    idx = sklearn_split_indices(y, 0.15, 0.15, 3)
    assert torch.equal(every_y, torch.cat([y[i] for i in idx]))


def test_digits_are_read_as_scikit_learn_loads_them_without_importing_it() -> None:
    from sklearn.datasets import load_digits

    from runner.data import digits

    images, target = digits.load_digits()
    reference = load_digits()
    assert images.dtype == reference.images.dtype and np.array_equal(images, reference.images)
    assert target.dtype == reference.target.dtype and np.array_equal(target, reference.target)
    code = "import sys; from runner.data import digits; digits.build(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
