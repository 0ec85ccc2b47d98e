"""runner/data/transforms.py and the per-sample wrapper of runner/data/images.py: what each augmentation
really does to pixels, that evaluation never augments, mixup/cutmix soft labels, reproducibility by seed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from runner.data.images import AugmentedImages
from runner.data.transforms import batch_mixing, image_transforms
from runner.engine.loader import make_loader

MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
SHAPE = (3, 8, 8)


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, *SHAPE), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _normalised(x: torch.Tensor) -> torch.Tensor:
    shape = (-1, 1, 1)
    return (x.float() / 255 - torch.tensor(MEAN).view(shape)) / torch.tensor(STD).view(shape)


def _windows(image: torch.Tensor, padding: int) -> dict[tuple[int, int], torch.Tensor]:
    """Every HxW window of the reflection-padded image, by its offset."""
    padded = F.pad(image.float().unsqueeze(0), [padding] * 4, mode="reflect")[0]
    h, w = image.shape[1:]
    return {(i, j): padded[:, i:i + h, j:j + w] for i in range(2 * padding + 1) for j in range(2 * padding + 1)}


def test_eval_only_converts_and_normalises_whatever_augmentation_is_configured() -> None:
    tf = image_transforms(False, SHAPE, crop_padding=3, hflip=True, auto_augment="randaugment", mean=MEAN, std=STD)
    x = _images(20)
    for image in x:
        first, second = tf(image), tf(image)
        assert first.dtype == torch.float32 and type(first) is torch.Tensor and first.shape == SHAPE
        assert torch.equal(first, second)
        assert torch.allclose(first, _normalised(image), atol=1e-5)
    # without mean/std: scaled to [0, 1] only; a whole batch transforms like its images
    plain = image_transforms(False, SHAPE)
    assert torch.allclose(plain(x), x.float() / 255)


def test_hflip_gives_the_image_or_its_mirror_and_both_occur() -> None:
    tf = image_transforms(True, SHAPE, hflip=True)
    image = _images(1)[0]
    torch.manual_seed(0)
    outcomes = []
    for _ in range(40):
        out = tf(image)
        if torch.allclose(out, image.float() / 255, atol=1e-6):
            outcomes.append("same")
        elif torch.allclose(out, image.flip(-1).float() / 255, atol=1e-6):
            outcomes.append("flipped")
        else:
            outcomes.append("other")
    assert "other" not in outcomes and {"same", "flipped"} <= set(outcomes)


def test_random_crop_takes_windows_of_the_reflection_padded_image_at_varying_offsets() -> None:
    tf = image_transforms(True, SHAPE, crop_padding=2)
    image = _images(1)[0]
    windows = _windows(image, 2)
    torch.manual_seed(0)
    offsets = []
    for _ in range(40):
        out = tf(image) * 255
        assert out.shape == SHAPE
        hits = [offset for offset, window in windows.items() if torch.allclose(out, window, atol=1e-3)]
        assert hits, "every output is a window of the padded image"
        offsets.append(hits[0])
    assert len(set(offsets)) > 5 and any(offset != (2, 2) for offset in offsets)


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment"])
def test_auto_augment_changes_images_and_takes_pil_input(policy: str) -> None:
    tf = image_transforms(True, SHAPE, auto_augment=policy, randaugment_n=2, randaugment_m=15, mean=MEAN, std=STD)
    x = _images(30)
    torch.manual_seed(0)
    changed = sum(not torch.allclose(tf(image), _normalised(image), atol=1e-5) for image in x)
    assert changed >= 10
    pil = Image.fromarray(x[0].permute(1, 2, 0).numpy())
    out = tf(pil)
    assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.shape == SHAPE


@pytest.mark.parametrize("kwargs, key", [
    (dict(crop_padding=8), "crop_padding"), (dict(crop_padding=-1), "crop_padding"),
    (dict(auto_augment="autoaugment"), "auto_augment"), (dict(randaugment_n=0), "randaugment_n"),
    (dict(randaugment_m=31), "randaugment_m"), (dict(mean=[0.5] * 3), "mean"),
    (dict(mean=[0.5] * 2, std=[0.2] * 2), "mean"), (dict(mean=MEAN, std=[0.2, 0.0, 0.2]), "std"),
])
def test_bad_arguments_fail_in_one_line_naming_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError) as error:
        image_transforms(False, SHAPE, **kwargs)
    message = str(error.value)
    assert message.startswith(f"{key}: ") and "allowed" in message and "\n" not in message


def test_no_mixing_when_both_alphas_are_zero_and_bad_alphas_fail() -> None:
    assert batch_mixing(10) is None
    with pytest.raises(ValueError, match=r"^mixup_alpha: -1"):
        batch_mixing(10, mixup_alpha=-1)
    with pytest.raises(ValueError, match=r"^cutmix_alpha: nan"):
        batch_mixing(10, cutmix_alpha=float("nan"))


def test_mixup_blends_images_and_labels_with_one_weight() -> None:
    mix = batch_mixing(5, mixup_alpha=1.0)
    x, y = _normalised(_images(6)), torch.tensor([0, 1, 2, 3, 4, 0])
    torch.manual_seed(1)
    mixed, soft = mix(x, y)
    assert soft.shape == (6, 5) and soft.dtype == torch.float32
    assert torch.allclose(soft.sum(1), torch.ones(6))
    lam = soft[1, 1].item()  # sample 1 (class 1) takes lam of itself and 1 - lam of sample 0 (class 0)
    assert 0 < lam < 1
    assert torch.allclose(mixed, lam * x + (1 - lam) * x.roll(1, 0), atol=1e-5)
    assert torch.allclose(soft, lam * F.one_hot(y, 5) + (1 - lam) * F.one_hot(y.roll(1, 0), 5), atol=1e-6)


def test_cutmix_pastes_a_box_and_weights_labels_by_its_area() -> None:
    mix = batch_mixing(4, cutmix_alpha=1.0)
    x, y = _normalised(_images(4)), torch.tensor([0, 1, 2, 3])
    for seed in range(5):
        torch.manual_seed(seed)
        mixed, soft = mix(x, y)
        assert torch.allclose(soft.sum(1), torch.ones(4))
        own = (mixed == x).all(1)  # per pixel: kept from the sample itself, else pasted from its neighbour
        assert ((mixed == x.roll(1, 0)).all(1) | own).all()
        kept_share = own.float().mean((1, 2))
        assert torch.allclose(soft[torch.arange(4), y], kept_share, atol=1e-6)


def test_both_mixers_on_pick_one_per_batch_and_both_occur() -> None:
    mix = batch_mixing(4, mixup_alpha=1.0, cutmix_alpha=1.0)
    x, y = _normalised(_images(4)), torch.tensor([0, 1, 2, 3])
    torch.manual_seed(0)
    kinds = set()
    for _ in range(20):
        mixed, soft = mix(x, y)
        assert torch.allclose(soft.sum(1), torch.ones(4))
        pasted = ((mixed == x).all(1) | (mixed == x.roll(1, 0)).all(1)).all()
        kinds.add("cutmix" if pasted else "mixup")
    assert kinds == {"cutmix", "mixup"}


def test_mixing_is_reproducible_from_the_global_seed() -> None:
    mix = batch_mixing(4, mixup_alpha=0.4, cutmix_alpha=1.0)
    x, y = _normalised(_images(4)), torch.tensor([0, 1, 2, 3])
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append([mix(x, y) for _ in range(4)])
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(runs[0], runs[1]))
    differ = any(not torch.equal(a[1], b[1]) for a, b in zip(runs[0], runs[2]))
    assert same and differ


def _augmented(n: int = 32) -> AugmentedImages:
    tf = image_transforms(True, SHAPE, crop_padding=2, hflip=True, auto_augment="trivialaugment", mean=MEAN, std=STD)
    return AugmentedImages(_images(n), torch.arange(n) % 3, tf)


def _epochs(dataset, seed: int, num_workers: int, epochs: int = 2) -> list[torch.Tensor]:
    loader = make_loader(dataset, 16, seed=seed, shuffle=True, num_workers=num_workers, pin_memory=False)
    batches = []
    for epoch in range(epochs):
        loader.batch_sampler.set_epoch(epoch)
        batches.extend(torch.cat([x.flatten(), y.float()]) for x, y in loader)
    return batches


def test_wrapper_items_are_augmented_per_read_with_labels_and_shapes() -> None:
    data = _augmented()
    x, y = data[4]
    assert x.shape == SHAPE and x.dtype == torch.float32 and y.dtype == torch.int64 and y.item() == 1
    torch.manual_seed(0)
    assert not torch.equal(data[4][0], data[4][0])  # a new draw on every read
    with pytest.raises(ValueError, match=r"^images: a torch.float32 tensor"):
        AugmentedImages(torch.zeros(2, *SHAPE), torch.zeros(2), lambda image: image)


def test_same_seed_same_augmented_batches_in_the_main_process() -> None:
    data = _augmented()
    runs = []
    for seed, global_seed in ((7, 1), (7, 2), (8, 1)):
        torch.manual_seed(global_seed)  # the loader keys every item by (its seed, epoch, index): that decides
        runs.append(_epochs(data, seed=seed, num_workers=0))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))


def test_same_loader_seed_same_augmented_batches_in_workers() -> None:
    data = _augmented()
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(123)  # the workers' RNG comes from the loader's seed, not from the parent's state
        runs.append(_epochs(data, seed=seed, num_workers=2))
    assert len(runs[0]) == 2 * 2
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    # a different seed reorders and re-draws; compare sorted per-sample rows so order alone cannot pass it
    assert not torch.equal(torch.cat(runs[0]).sort().values, torch.cat(runs[2]).sort().values)
    assert np.isfinite(torch.cat(runs[0]).numpy()).all()


def _keyed_epoch(seed: int, epoch: int, size: int, batch: int, start: int = 0) -> list[list[tuple[int, int]]]:
    """What a loader passing sample seeds would yield: (index, seed from (run seed, epoch, index))."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    keys = [(i, (seed * 1_000_003 + epoch) * 2**24 + i) for i in order]
    return [keys[b:b + batch] for b in range(start, size, batch)]


def test_a_sample_seed_fixes_the_augmentation_and_leaves_the_global_rng_alone() -> None:
    data = _augmented()
    torch.manual_seed(0)
    first = data[(3, 42)][0]
    state = torch.get_rng_state()
    torch.manual_seed(1)
    assert torch.equal(data[(3, 42)][0], first) and not torch.equal(data[(3, 43)][0], first)
    torch.manual_seed(0)
    data[(3, 42)]
    assert torch.equal(torch.get_rng_state(), state)


def test_sample_seeds_make_batches_independent_of_workers_and_of_a_resume_mid_epoch() -> None:
    from torch.utils.data import DataLoader

    data = _augmented()
    batches = {}
    for workers in (0, 2):
        loader = DataLoader(data, batch_sampler=_keyed_epoch(9, 1, len(data), 8), num_workers=workers)
        batches[workers] = [x for x, _ in loader]
    resumed = DataLoader(data, batch_sampler=_keyed_epoch(9, 1, len(data), 8, start=16), num_workers=2)
    assert all(torch.equal(a, b) for a, b in zip(batches[0], batches[2]))
    assert all(torch.equal(a, b) for a, b in zip(batches[0][2:], [x for x, _ in resumed]))
    other_epoch = DataLoader(data, batch_sampler=_keyed_epoch(9, 2, len(data), 8), num_workers=0)
    assert not torch.equal(torch.cat(batches[0]).sort(0).values, torch.cat([x for x, _ in other_epoch]).sort(0).values)
