"""A folder of your own images, one subfolder per class:

    <root>/train/<class>/*.jpg|png|...     required
    <root>/val/<class>/...                 optional; without it, val_fraction of train is held out
    <root>/test/<class>/...                optional; without it, the test split is empty

Class names are sorted and numbered as torchvision's ImageFolder numbers them, from train/. Images are
decoded to RGB when read (in DataLoader workers when num_workers > 0), so the folder can be larger than
memory; train augments per sample, val and test never do.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import torch

from runner.data.images import AugmentedImages, ImageDecoder
from runner.data.splits import DataSplits, split_indices
from runner.data.transforms import batch_mixing, image_transforms

LAYOUT = "<root>/train/<class>/<image> (optional val/ and test/ the same way)"
# ImageNet's channel statistics: the right normalisation for pretrained backbones, and a fair one for
# photographs in general; a folder's own statistics would need every image decoded before training
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def build(root: str = "datasets/images", image_size: Optional[int] = None, val_fraction: float = 0.1,
          split_seed: int = 0, crop_padding: int = 0, hflip: bool = False,
          auto_augment: Literal["none", "randaugment", "trivialaugment"] = "none", randaugment_n: int = 2,
          randaugment_m: int = 9, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
          mean: Optional[list[float]] = None, std: Optional[list[float]] = None) -> DataSplits:
    """Splits of the class folders under `root`; `mean`/`std` null means ImageNet's statistics.

    `image_size` resizes every image to image_size x image_size (shorter side, then centre crop); null
    keeps the images as they are, which then must all be the size of the first training image.
    `val_fraction` (stratified, by `split_seed`) applies only when there is no val/ folder.
    """
    if image_size is not None and image_size < 1:
        raise ValueError(f"image_size: {image_size} is too small; allowed: an integer >= 1, or null")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction: {val_fraction} is out of range; allowed: 0 <= val_fraction < 1")
    if mean is None and std is None:
        mean, std = IMAGENET_MEAN, IMAGENET_STD
    base = Path(root)
    if not (base / "train").is_dir():
        raise ValueError(f"root: {base.resolve()} has no train/ folder; expected {LAYOUT}")
    classes, paths, labels = _scan(base, "train", None)
    if not paths:
        raise ValueError(f"root: {base.resolve() / 'train'} holds no images; expected {LAYOUT}")
    class_to_idx = {name: i for i, name in enumerate(classes)}
    parts = {name: _scan(base, name, class_to_idx)[1:] if (base / name).is_dir() else ([], [])
             for name in ("val", "test")}
    if not (base / "val").is_dir():
        train_idx, val_idx, _ = split_indices(torch.tensor(labels), val_fraction, 0.0, split_seed)
        parts["val"] = ([paths[i] for i in val_idx], [labels[i] for i in val_idx])
        paths, labels = [paths[i] for i in train_idx], [labels[i] for i in train_idx]

    if image_size is None:
        first = ImageDecoder()(paths[0])
        decode = ImageDecoder(size=(first.shape[1], first.shape[2]))
        input_shape = tuple(first.shape)
    else:
        decode, input_shape = ImageDecoder(image_size=image_size), (3, image_size, image_size)
    augment = dict(crop_padding=crop_padding, hflip=hflip, auto_augment=auto_augment, randaugment_n=randaugment_n,
                   randaugment_m=randaugment_m, mean=mean, std=std)
    train_tf = image_transforms(True, input_shape, **augment)  # type: ignore[arg-type]
    eval_tf = image_transforms(False, input_shape, **augment)  # type: ignore[arg-type]

    def dataset(files: list[str], targets: list[int], transform) -> AugmentedImages:
        return AugmentedImages(files, torch.tensor(targets, dtype=torch.long), transform, decode)

    return DataSplits(train=dataset(paths, labels, train_tf), val=dataset(*parts["val"], eval_tf),
                      test=dataset(*parts["test"], eval_tf), input_shape=input_shape, num_classes=len(classes),
                      batch_transform=batch_mixing(len(classes), mixup_alpha, cutmix_alpha))


def _scan(base: Path, split: str,
          class_to_idx: Optional[dict[str, int]]) -> tuple[list[str], list[str], list[int]]:
    """Class names, image paths and labels of one split folder, in torchvision ImageFolder's order."""
    # imported here: torchvision costs seconds to import, paid only by runs that use it
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    folder = base / split
    try:
        classes, found = find_classes(str(folder))
    except FileNotFoundError:
        raise ValueError(f"root: {folder.resolve()} has no class folders; expected {LAYOUT}") from None
    if class_to_idx is not None:
        unknown = sorted(set(classes) - set(class_to_idx))
        if unknown:
            raise ValueError(f"root: {folder.resolve()} has class folders that train/ lacks ({', '.join(unknown)}); "
                             f"expected the class folders of train/")
        found = class_to_idx
    samples = make_dataset(str(folder), found, extensions=IMG_EXTENSIONS, allow_empty=True)
    if class_to_idx is None:
        empty = sorted(set(classes) - {classes[label] for _, label in samples})
        if empty and len(empty) < len(classes):
            raise ValueError(f"root: {folder.resolve()} has class folders without images ({', '.join(empty)}); "
                             f"expected at least one {'/'.join(IMG_EXTENSIONS)} file in each")
    return classes, [path for path, _ in samples], [label for _, label in samples]
