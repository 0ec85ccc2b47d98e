"""runner/data: MNIST, Fashion-MNIST and CIFAR-10 read from files in their real on-disk formats."""
from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch



def _write_idx(path: Path, array: np.ndarray) -> None:
    # idx format: zero bytes, type code 0x08 (ubyte), rank, big-endian dims, then the raw bytes
    path.write_bytes(struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.astype(np.uint8).tobytes())


def _write_mnist(root: Path, folder: str, n_train: int, n_test: int) -> None:
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)


def _write_cifar(root: Path, per_batch: int) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"batch_label": name, "labels": [i % 10 for i in range(per_batch)],
                 "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "filenames": [f"{i}.png" for i in range(per_batch)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_family_loads_idx_files(tmp_path: Path, name: str, folder: str) -> None:
    _write_mnist(tmp_path, folder, n_train=100, n_test=30)
    splits = build_datasets(name, root=str(tmp_path), val_fraction=0.2)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (80, 20, 30)
    assert splits.input_shape == (1, 28, 28) and splits.num_classes == 10
    x, y = splits.test[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y.item() == 3


def test_cifar10_loads_pickled_batches(tmp_path: Path) -> None:
    _write_cifar(tmp_path, per_batch=20)
    splits = build_datasets("cifar10", root=str(tmp_path), val_fraction=0.1)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (90, 10, 20)
    assert splits.input_shape == (3, 32, 32)
    train_x = splits.train.tensors[0]
    # per-channel standardized with the train split's statistics
    assert torch.allclose(train_x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)
    assert splits.test[7][1].item() == 7


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10"])
def test_missing_dataset_says_where_and_how_to_fetch(tmp_path: Path, name: str) -> None:
    # a plain ValueError naming the builder's own argument, as a user's builder raises it
    with pytest.raises(ValueError, match=f"^(download|root): .*{tmp_path}.*set download=true"):
        build_datasets(name, root=str(tmp_path))


def build_datasets(name: str = "digits", **kwargs):
    """The dataset option `name` built as the engine builds it: its YAML's _target_ with these arguments."""
    import yaml

    from runner.specs import components
    from runner.specs.registry import CONF_DIR

    target = yaml.safe_load((CONF_DIR / "dataset" / f"{name}.yaml").read_text())["_target_"]
    return components.load_target("dataset", target)(**kwargs)
