"""runner/data/cifar.py on a small CIFAR-10 written in the real pickle layout (cifar-10-batches-py)."""
from __future__ import annotations

import pickle
from itertools import islice
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from hydra.utils import instantiate

from runner.data import cifar
from runner.engine.loader import make_loader
from runner.specs.registry import CONF_DIR

PER_BATCH, N_TEST = 60, 50


def _write_cifar(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """Five training batches and a test batch as the official files hold them: pickled dicts with
    b"data" (uint8 [N, 3072], channel-major rows) and b"labels"; returns all train then test images."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train, test = [], []
    for name, n in [(f"data_batch_{i}", PER_BATCH) for i in range(1, 6)] + [("test_batch", N_TEST)]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        batch = {b"batch_label": name.encode(), b"labels": [i % 10 for i in range(n)], b"data": data,
                 b"filenames": [f"{i}.png".encode() for i in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        (test if name == "test_batch" else train).append(data.reshape(n, 3, 32, 32))
    return np.concatenate(train), np.concatenate(test)


def _normalised(images: torch.Tensor) -> torch.Tensor:
    shape = (1, 3, 1, 1) if images.dim() == 4 else (3, 1, 1)
    mean, std = torch.tensor(cifar.CIFAR10_MEAN).view(shape), torch.tensor(cifar.CIFAR10_STD).view(shape)
    return (images.float() / 255 - mean) / std


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    root = tmp_path_factory.mktemp("cifar")
    return (root, *_write_cifar(root))


def test_splits_shapes_and_labels(written) -> None:
    root, train_images, _ = written
    splits = cifar.build(str(root), val_fraction=0.1)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (270, 30, 50)
    assert splits.input_shape == (3, 32, 32) and splits.num_classes == 10 and splits.batch_transform is None
    assert splits.train.images.dtype == torch.uint8 and splits.train.images.shape == (270, 3, 32, 32)
    assert Counter(splits.val.tensors[1].tolist()) == {c: 3 for c in range(10)}  # stratified
    x, y = splits.train[5]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    # the reader keeps file order: train holds the official images it was given, labels with them
    row = next(i for i in range(len(train_images)) if np.array_equal(train_images[i], splits.train.images[5].numpy()))
    assert y.item() == (row % PER_BATCH) % 10


def test_eval_splits_are_the_images_normalised_never_augmented(written) -> None:
    root, _, test_images = written
    splits = cifar.build(str(root), crop_padding=4, hflip=True, auto_augment="trivialaugment")
    passes = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        loader = make_loader(splits.test, 16, seed=seed, shuffle=False, num_workers=0, pin_memory=False)
        passes.append(torch.cat([x for x, _ in loader]))
    assert torch.equal(passes[0], passes[1])
    assert torch.allclose(passes[0], _normalised(torch.from_numpy(test_images)), atol=1e-5)
    assert splits.test[7][1].item() == 7


def test_train_takes_padded_crops_and_flips_of_its_images(written) -> None:
    root = written[0]
    splits = cifar.build(str(root))  # the recipe's defaults: crop with padding 4, horizontal flip
    torch.manual_seed(0)
    kinds = Counter()
    for i in range(30):
        image = splits.train.images[i]
        padded = F.pad(_normalised(image).unsqueeze(0), [4] * 4, mode="reflect")[0]
        out = splits.train[i][0]
        for flipped, source in ((False, padded), (True, padded.flip(-1))):
            match = [(a, b) for a in range(9) for b in range(9)
                     if torch.allclose(out, source[:, a:a + 32, b:b + 32], atol=1e-4)]
            if match:
                kinds[(flipped, match[0] != (4, 4))] += 1
                break
        else:
            pytest.fail(f"train item {i} is no crop of its padded image, flipped or not")
    assert kinds[(True, True)] > 0 and kinds[(False, True)] > 0  # flips and shifts both happen


def test_same_seed_same_augmented_batches_and_mixup_soft_labels(written) -> None:
    root = written[0]
    splits = cifar.build(str(root), mixup_alpha=0.2)
    runs = []
    for seed, global_seed in ((5, 1), (5, 2), (6, 1)):
        torch.manual_seed(global_seed)  # the run's own seed decides: items are keyed by (seed, epoch, index)
        loader = make_loader(splits.train, 32, seed=seed, shuffle=False, num_workers=0, pin_memory=False)
        runs.append(torch.cat([x for x, _ in islice(loader, 2)]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    x, y = next(iter(make_loader(splits.train, 8, seed=0, shuffle=True, num_workers=0, pin_memory=False)))
    mixed, soft = splits.batch_transform(x, y)
    assert soft.shape == (8, 10) and torch.allclose(soft.sum(1), torch.ones(8)) and mixed.shape == x.shape


def test_missing_files_fail_in_one_line_naming_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as error:
        cifar.build(str(tmp_path))
    message = str(error.value)
    assert message.startswith(f"root: CIFAR-10 not found in {tmp_path.resolve() / 'cifar-10-batches-py'}")
    assert "data_batch_1" in message and "download=true" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"^auto_augment: 'autoaugment'"):
        cifar.build(str(tmp_path), auto_augment="autoaugment")


def test_the_yaml_option_instantiates_its_builder(written) -> None:
    config = yaml.safe_load((CONF_DIR / "dataset" / "cifar10_augmented.yaml").read_text())
    assert config["crop_padding"] == 4 and config["hflip"] is True
    splits = instantiate({**config, "root": str(written[0])})
    assert len(splits.train) == 270 and splits.input_shape == (3, 32, 32)
