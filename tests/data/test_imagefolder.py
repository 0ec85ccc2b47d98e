"""runner/data/imagefolder.py on real class folders of PNG and JPEG files written into tmp_path."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hydra.utils import instantiate
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.io import decode_image

from runner.data import imagefolder
from runner.engine.loader import make_loader
from runner.specs.registry import CONF_DIR

MEAN, STD = imagefolder.IMAGENET_MEAN, imagefolder.IMAGENET_STD
CLASSES = ("zebra", "ant", "Bee")  # sorted as ImageFolder sorts: Bee, ant, zebra


def _write(root: Path, split: str, per_class: int, suffix: str = "png", size: tuple[int, int] = (8, 8),
           classes: tuple[str, ...] = CLASSES, seed: int = 0) -> dict[str, np.ndarray]:
    """Random RGB images saved as files; returns the pixels written, (H, W, 3) uint8, by path."""
    rng = np.random.default_rng(seed)
    written = {}
    for name in classes:
        folder = root / split / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            path = folder / f"{i:03d}.{suffix}"
            Image.fromarray(pixels).save(path)
            written[str(path)] = pixels
    return written


def _normalised(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels.float() / 255 - torch.tensor(MEAN).view(-1, 1, 1)) / torch.tensor(STD).view(-1, 1, 1)


def _chw(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(pixels).permute(2, 0, 1)


def test_classes_numbered_as_imagefolder_and_val_carved_stratified(tmp_path: Path) -> None:
    _write(tmp_path, "train", per_class=6)
    splits = imagefolder.build(str(tmp_path), val_fraction=1 / 3, split_seed=0)
    assert splits.num_classes == 3 and splits.input_shape == (3, 8, 8)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (12, 6, 0)
    reference = dict(ImageFolder(str(tmp_path / "train")).samples)
    for part in (splits.train, splits.val):
        assert all(reference[path] == label for path, label in zip(part.images, part.labels.tolist()))
    assert Counter(splits.val.labels.tolist()) == {0: 2, 1: 2, 2: 2}
    assert set(splits.train.images).isdisjoint(splits.val.images)
    x, y = splits.train[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    again = imagefolder.build(str(tmp_path), val_fraction=1 / 3, split_seed=0)
    other = imagefolder.build(str(tmp_path), val_fraction=1 / 3, split_seed=1)
    assert again.val.images == splits.val.images and other.val.images != splits.val.images


def test_val_and_test_folders_are_used_as_given(tmp_path: Path) -> None:
    _write(tmp_path, "train", per_class=4, suffix="jpg")
    _write(tmp_path, "val", per_class=2, suffix="jpg", seed=1)
    _write(tmp_path, "test", per_class=3, suffix="jpeg", classes=("ant", "zebra"), seed=2)
    splits = imagefolder.build(str(tmp_path), val_fraction=0.5)  # ignored: val/ exists
    assert (len(splits.train), len(splits.val), len(splits.test)) == (12, 6, 6)
    assert splits.num_classes == 3 and sorted(set(splits.test.labels.tolist())) == [1, 2]
    path = splits.test.images[0]
    assert Path(path).parent.name == "ant" and splits.test[0][1].item() == 1
    # JPEG is lossy: the item is the file as decoded, normalised
    assert torch.allclose(splits.test[0][0], _normalised(decode_image(path)), atol=1e-5)


def test_eval_items_are_the_images_normalised_and_never_augmented(tmp_path: Path) -> None:
    written = _write(tmp_path, "train", per_class=8)
    splits = imagefolder.build(str(tmp_path), val_fraction=0.25, crop_padding=3, hflip=True,
                               auto_augment="randaugment", randaugment_m=20)
    passes = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        loader = make_loader(splits.val, 4, seed=seed, shuffle=False, num_workers=0, pin_memory=False)
        passes.append(torch.cat([x for x, _ in loader]))
    assert torch.equal(passes[0], passes[1])
    expected = torch.stack([_normalised(_chw(written[path])) for path in splits.val.images])
    assert torch.allclose(passes[0], expected, atol=1e-5)
    torch.manual_seed(0)
    train_changed = sum(not torch.allclose(splits.train[i][0], _normalised(_chw(written[splits.train.images[i]])),
                                           atol=1e-5) for i in range(len(splits.train)))
    assert train_changed >= len(splits.train) // 2


def test_train_flip_is_really_applied(tmp_path: Path) -> None:
    written = _write(tmp_path, "train", per_class=2)
    splits = imagefolder.build(str(tmp_path), val_fraction=0.0, hflip=True)
    original = _normalised(_chw(written[splits.train.images[0]]))
    torch.manual_seed(0)
    seen = set()
    for _ in range(20):
        x = splits.train[0][0]
        seen.add("same" if torch.allclose(x, original, atol=1e-5)
                 else "flipped" if torch.allclose(x, original.flip(-1), atol=1e-5) else "other")
    assert seen == {"same", "flipped"}


def test_image_size_resizes_every_image_and_mixed_sizes_need_it(tmp_path: Path) -> None:
    _write(tmp_path, "train", per_class=2, suffix="jpg", size=(10, 14), classes=("a", "b"))
    _write(tmp_path, "val", per_class=2, suffix="png", size=(20, 12), classes=("a", "b"))
    Image.fromarray(np.full((9, 9), 128, np.uint8)).save(tmp_path / "val" / "a" / "grey.bmp")
    splits = imagefolder.build(str(tmp_path), image_size=6)
    assert splits.input_shape == (3, 6, 6) and len(splits.val) == 5
    assert all(splits.val[i][0].shape == (3, 6, 6) for i in range(len(splits.val)))
    grey = splits.val.images.index(str(tmp_path / "val" / "a" / "grey.bmp"))
    assert torch.allclose(splits.val[grey][0], _normalised(torch.full((3, 6, 6), 128)), atol=1e-5)

    as_is = imagefolder.build(str(tmp_path))
    assert as_is.input_shape == (3, 10, 14) and as_is.train[0][0].shape == (3, 10, 14)
    with pytest.raises(ValueError, match=r"^image_size: .*a/000.png is 20x12 but the first training image is 10x14"):
        as_is.val[0]


def test_same_seed_same_batches_in_workers_and_mixing_gives_soft_labels(tmp_path: Path) -> None:
    _write(tmp_path, "train", per_class=6)
    splits = imagefolder.build(str(tmp_path), val_fraction=0.0, crop_padding=2, hflip=True, mixup_alpha=0.2,
                               cutmix_alpha=1.0)
    runs = []
    for seed in (3, 3, 4):
        loader = make_loader(splits.train, 6, seed=seed, shuffle=True, num_workers=2, pin_memory=False)
        runs.append([(x, y) for x, y in loader])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(runs[0], runs[1]))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(runs[0], runs[2]))
    x, y = runs[0][0]
    mixed, soft = splits.batch_transform(x, y)
    assert mixed.shape == x.shape and soft.shape == (6, 3) and torch.allclose(soft.sum(1), torch.ones(6))


@pytest.mark.parametrize("layout, expected", [
    ("missing", "has no train/ folder"),
    ("empty_train", "has no class folders"),
    ("no_images", "holds no images"),
    ("class_without_images", "has class folders without images (zebra)"),
    ("unknown_val_class", "has class folders that train/ lacks (cat)"),
])
def test_bad_folders_fail_in_one_line_naming_root(tmp_path: Path, layout: str, expected: str) -> None:
    root = tmp_path / "images"
    if layout != "missing":
        (root / "train").mkdir(parents=True)
    if layout == "no_images":
        (root / "train" / "ant").mkdir()
        (root / "train" / "ant" / "notes.txt").write_text("not an image")
    if layout == "class_without_images":
        _write(root, "train", per_class=2, classes=("ant",))
        (root / "train" / "zebra").mkdir()
    if layout == "unknown_val_class":
        _write(root, "train", per_class=2, classes=("ant",))
        _write(root, "val", per_class=1, classes=("ant", "cat"))
    with pytest.raises(ValueError) as error:
        imagefolder.build(str(root))
    message = str(error.value)
    assert message.startswith(f"root: {root.resolve()}") and expected in message and "\n" not in message


def test_bad_values_fail_before_any_file_is_read(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^image_size: 0 "):
        imagefolder.build(str(tmp_path), image_size=0)
    with pytest.raises(ValueError, match=r"^val_fraction: 1.5 "):
        imagefolder.build(str(tmp_path), val_fraction=1.5)


def test_the_yaml_option_instantiates_its_builder(tmp_path: Path) -> None:
    _write(tmp_path, "train", per_class=4)
    config = yaml.safe_load((CONF_DIR / "dataset" / "imagefolder.yaml").read_text())
    splits = instantiate({**config, "root": str(tmp_path), "image_size": 4})
    assert splits.input_shape == (3, 4, 4) and splits.num_classes == 3 and splits.batch_transform is None
    assert len(splits.val) == 2 and splits.train[0][0].shape == (3, 4, 4)
