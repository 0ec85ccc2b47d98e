"""The epoch's micro-batches dealt across ranks: no sample repeated or lost, equal batch counts, exact restarts."""
from __future__ import annotations

import pytest

from runner.engine.loader import EpochBatches


@pytest.mark.parametrize("size, batch, world", [(101, 10, 2), (17, 16, 2), (1, 4, 3), (50, 7, 4), (64, 8, 2), (9, 3, 1)])
def test_every_sample_once_and_every_rank_as_many_micro_batches(size: int, batch: int, world: int) -> None:
    ranks = [EpochBatches(size, batch, seed=3, shuffle=True, dp_rank=r, dp_degree=world) for r in range(world)]
    per_rank = [list(r) for r in ranks]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == ranks[0].batches_per_epoch() == len(ranks[0])
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(size))  # none repeated, none lost
    # global micro-batch k on N ranks holds the samples of micro-batch k of one process at batch N*B
    single = list(EpochBatches(size, batch * world, seed=3, shuffle=True))
    for k, whole in enumerate(single):
        assert sorted(i for batches in per_rank for i in batches[k]) == sorted(whole)


def test_order_depends_on_seed_and_epoch_and_a_start_skips_exactly_that_many_samples() -> None:
    a, b = EpochBatches(40, 4, seed=1, shuffle=True), EpochBatches(40, 4, seed=1, shuffle=True)
    a.set_epoch(2)
    b.set_epoch(2, start=12)
    full, rest = list(a), list(b)
    assert rest == full[3:] and len(b) == 7
    a.set_epoch(3)
    assert list(a) != full
    assert [i for batch in EpochBatches(10, 4, seed=0, shuffle=False) for i in batch] == list(range(10))


@pytest.mark.parametrize("workers", [0, 2])
def test_augmented_batches_resume_mid_epoch_exactly_with_or_without_workers(workers: int) -> None:
    """Random augmentation keyed by (seed, epoch, index): a loader started mid-epoch (a resume) gives the
    same augmented batches as the uninterrupted epoch, whichever worker reads them."""
    import torch

    from runner.data.images import AugmentedImages
    from runner.data.transforms import image_transforms
    from runner.engine.loader import make_loader

    images = torch.randint(0, 256, (40, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    data = AugmentedImages(images, torch.arange(40) % 4, image_transforms(True, (3, 16, 16), crop_padding=4, hflip=True))

    def epoch(start: int) -> list:
        loader = make_loader(data, 8, seed=5, shuffle=True, num_workers=workers, pin_memory=False)
        loader.batch_sampler.set_epoch(1, start=start)
        return [x for x, _ in loader]

    full, resumed = epoch(0), epoch(16)
    assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(full[2:], resumed))
    assert not torch.equal(full[0], data[0][0].unsqueeze(0).expand_as(full[0]))  # really augmented


def test_a_small_tensor_dataset_lives_on_the_gpu_only_when_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch.utils.data import TensorDataset

    from runner.engine import loader

    data = TensorDataset(torch.zeros(100, 10), torch.zeros(100, dtype=torch.long))  # 4000 + 800 bytes
    assert loader.on_device(data, torch.device("cpu")) is data  # the CPU: nothing to move
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10_000, 80_000))
    assert not loader.fits(data, torch.device("cuda"), budget=0.25)  # 4800 > 2500
    assert loader.fits(data, torch.device("cuda"), budget=0.5)
