"""The epoch's micro-batches dealt across ranks: no sample repeated or lost, equal batch counts, exact restarts."""
from __future__ import annotations

import pytest

from runner.loader import EpochBatches


@pytest.mark.parametrize("size, batch, world", [(101, 10, 2), (17, 16, 2), (1, 4, 3), (50, 7, 4), (64, 8, 2), (9, 3, 1)])
def test_every_sample_once_and_every_rank_as_many_micro_batches(size: int, batch: int, world: int) -> None:
    ranks = [EpochBatches(size, batch, seed=3, shuffle=True, rank=r, world=world) for r in range(world)]
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
