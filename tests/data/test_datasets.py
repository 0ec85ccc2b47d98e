"""runner/data: digits and synthetic splits, their sizes, disjointness and determinism."""
from __future__ import annotations

import pytest
import torch

from runner.data import split_indices


def test_digits_splits_cover_all_samples_with_the_right_items() -> None:
    splits = build_datasets()
    sizes = [len(splits.train), len(splits.val), len(splits.test)]
    assert sum(sizes) == 1797
    assert sizes == [1257, 270, 270]  # val and test: ceil(0.15 * 1797) each
    assert splits.input_shape == (1, 8, 8) and splits.num_classes == 10
    x, y = splits.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64
    train_x, train_y = splits.train.tensors
    # standardized with train statistics: roughly zero mean, unit variance
    assert abs(train_x.mean().item()) < 1e-4 and train_x.std().item() == pytest.approx(1.0, abs=1e-3)
    assert set(train_y.tolist()) == set(range(10))


def test_digits_splits_are_disjoint_and_match_the_indices() -> None:
    from sklearn.datasets import load_digits

    labels = torch.from_numpy(load_digits().target)
    train, val, test = split_indices(labels, 0.15, 0.15, seed=0)
    together = torch.cat([train, val, test])
    assert len(set(together.tolist())) == len(together) == 1797
    splits = build_datasets()
    for idx, part in zip((train, val, test), (splits.train, splits.val, splits.test)):
        assert torch.equal(part.tensors[1], labels[idx])


def test_digits_split_is_stratified() -> None:
    splits = build_datasets()
    counts = torch.bincount(splits.test.tensors[1], minlength=10)
    assert counts.min() >= 25 and counts.max() <= 29  # ~15% of ~180 per class


def test_digits_split_depends_only_on_split_seed() -> None:
    a, b = build_datasets(), build_datasets()
    c = build_datasets(split_seed=1)
    for name in ("train", "val", "test"):
        assert torch.equal(getattr(a, name).tensors[0], getattr(b, name).tensors[0])
    assert not torch.equal(a.val.tensors[1], c.val.tensors[1])


def test_zero_fractions_give_empty_splits() -> None:
    splits = build_datasets(val_fraction=0.0, test_fraction=0.0)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (1797, 0, 0)


def test_fractions_leaving_no_training_data_are_refused() -> None:
    with pytest.raises(ValueError, match="^val_fraction: .* leave no training samples"):
        split_indices(torch.tensor([0, 1, 0]), 0.5, 0.4, seed=0)


def test_synthetic_shapes_classes_and_determinism() -> None:
    spec = dict(shape=(3, 16, 16), num_classes=5, size=400)
    splits = build_datasets("synthetic", **spec)
    assert splits.input_shape == (3, 16, 16) and splits.num_classes == 5
    assert len(splits.train) + len(splits.val) + len(splits.test) == 400
    x, y = splits.train.tensors
    assert x.shape[1:] == (3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert set(y.tolist()) == set(range(5))  # a random teacher still uses every class
    again = build_datasets("synthetic", **spec)
    assert torch.equal(x, again.train.tensors[0]) and torch.equal(y, again.train.tensors[1])
    other = build_datasets("synthetic", **spec, split_seed=7)
    assert not torch.equal(x[:10], other.train.tensors[0][:10])


def test_synthetic_labels_are_learnable() -> None:
    # a least-squares linear probe on the training inputs must beat chance by far on held-out data
    splits = build_datasets("synthetic", shape=(8,), num_classes=4, size=2000)
    (x, y), (xt, yt) = splits.train.tensors, splits.test.tensors
    weights = torch.linalg.lstsq(x, torch.nn.functional.one_hot(y, 4).float()).solution
    accuracy = ((xt @ weights).argmax(1) == yt).float().mean().item()
    assert accuracy > 0.7


def build_datasets(name: str = "digits", **kwargs):
    """The dataset option `name` built as the engine builds it: its YAML's _target_ with these arguments."""
    import yaml

    from runner.specs import components
    from runner.specs.registry import CONF_DIR

    target = yaml.safe_load((CONF_DIR / "dataset" / f"{name}.yaml").read_text())["_target_"]
    return components.load_target("dataset", target)(**kwargs)
