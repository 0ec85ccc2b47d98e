"""CIFAR-10 for the standard augmented recipe: 32x32 colour images in 10 classes, read from the
python-pickle batches under <root>/cifar-10-batches-py, official test set, validation carved from train.

The training images stay uint8 in memory and are augmented per sample when read (random crop with
padding, horizontal flip, optionally RandAugment/TrivialAugmentWide, then normalisation), with
mixup/cutmix as an optional batch transform. Validation and test never augment: they are normalised
once, here, into float tensors, which the loader reads a whole batch at a time.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import TensorDataset

from runner.data.images import AugmentedImages
from runner.data.splits import DataSplits, split_indices
from runner.data.transforms import batch_mixing, image_transforms

FOLDER = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
INPUT_SHAPE = (3, 32, 32)
# per-channel mean and standard deviation of the 50,000 training images, pixels scaled to [0, 1]
CIFAR10_MEAN = [0.4914, 0.4822, 0.4465]
CIFAR10_STD = [0.2470, 0.2435, 0.2616]


def build(root: str = "datasets", download: bool = False, val_fraction: float = 0.1, split_seed: int = 0,
          crop_padding: int = 4, hflip: bool = True,
          auto_augment: Literal["none", "randaugment", "trivialaugment"] = "none", randaugment_n: int = 2,
          randaugment_m: int = 9, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0) -> DataSplits:
    """Train (augmented per sample), val (val_fraction of train, stratified by split_seed) and the
    official test set; `download=True` fetches the archive through torchvision when it is missing."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction: {val_fraction} is out of range; allowed: 0 <= val_fraction < 1")
    augment = dict(crop_padding=crop_padding, hflip=hflip, auto_augment=auto_augment, randaugment_n=randaugment_n,
                   randaugment_m=randaugment_m, mean=CIFAR10_MEAN, std=CIFAR10_STD)
    # built before reading 180 MB of batches, so that a bad augmentation value fails at once
    train_tf = image_transforms(True, INPUT_SHAPE, **augment)  # type: ignore[arg-type]
    eval_tf = image_transforms(False, INPUT_SHAPE, **augment)  # type: ignore[arg-type]
    mixing = batch_mixing(10, mixup_alpha, cutmix_alpha)

    x_train, y_train, x_test, y_test = load(root, download)
    train, val, _ = split_indices(y_train, val_fraction, 0.0, split_seed)
    return DataSplits(train=AugmentedImages(x_train[train], y_train[train], train_tf),
                      val=_normalised(x_train[val], y_train[val], eval_tf),
                      test=_normalised(x_test, y_test, eval_tf),
                      input_shape=INPUT_SHAPE, num_classes=10, batch_transform=mixing)


def load(root: str, download: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 train images and labels, then test images and labels, from <root>/cifar-10-batches-py;
    `download` fetches the archive through torchvision when it is missing."""
    folder = Path(root) / FOLDER
    if download:
        from torchvision import datasets  # imported here: torchvision costs seconds to import

        datasets.CIFAR10(root, train=True, download=True)  # fetches and checks the archive once
    missing = [name for name in TRAIN_FILES + TEST_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"root: CIFAR-10 not found in {folder.resolve()} (missing {', '.join(missing)}); "
                         f"set download=true to fetch it")
    # read the batches directly: torchvision's loader insists on the md5 of the official files
    return (*read_batches(folder, TRAIN_FILES), *read_batches(folder, TEST_FILES))


def read_batches(folder: Path, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [N, 3, 32, 32] and int64 labels [N] of the named pickle batches, in order."""
    images, labels = [], []
    for name in names:
        batch = _read_batch(folder / name)
        images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, *INPUT_SHAPE))
        labels.append(np.asarray(batch["labels"], dtype=np.int64))
    return torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels))


def _read_batch(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            # the official batches are Python 2 pickles: read as bytes, their keys are b"data", b"labels"
            batch = pickle.load(f, encoding="bytes")
        batch = {key.decode() if isinstance(key, bytes) else key: value for key, value in batch.items()}
        if len(batch["data"]) != len(batch["labels"]) or np.asarray(batch["data"]).size % 3072:
            raise ValueError("images and labels do not pair up")
    except Exception as error:  # a damaged file fails in many ways inside pickle; each is the file's fault
        reason = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"root: {path} is not a CIFAR-10 python batch ({type(error).__name__}: {reason}); "
                         "delete the folder and set download=true to fetch it again") from None
    return batch


def _normalised(images: torch.Tensor, labels: torch.Tensor, eval_tf) -> TensorDataset:
    # the eval transform works on a batch as on one image; chunks bound the float temporaries
    parts = [eval_tf(chunk) for chunk in images.split(4096)]
    x = torch.cat(parts) if parts else torch.empty(0, *INPUT_SHAPE)
    return TensorDataset(x, labels.long())
