"""Data loaders whose order depends on (seed, epoch) alone and that can start mid-epoch.

torch's DistributedSampler has the per-epoch shuffle but no way to start at a position, so resuming
would mean re-reading the skipped batches; this sampler adds the start position (a checkpoint's
data position) and keeps DistributedSampler's padding so every rank sees as many samples.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset


class EpochSampler(Sampler[int]):
    def __init__(self, size: int, seed: int, shuffle: bool, rank: int = 0, world: int = 1, pad: bool = True):
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.rank, self.world, self.pad = rank, world, pad
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Order of `epoch`, skipping this rank's first `start` samples."""
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        if self.pad and self.world > 1:  # as DistributedSampler: repeat from the start
            total = math.ceil(self.size / self.world) * self.world
            order += order[: total - self.size]
        return order[self.rank::self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:])

    def __len__(self) -> int:
        return max(self.per_rank() - self.start, 0)

    def per_rank(self) -> int:
        return math.ceil(self.size / self.world) if self.pad else len(range(self.rank, self.size, self.world))


class BatchedTensors(Dataset):
    """A TensorDataset read a batch at a time: one gather per tensor instead of B item reads and a
    stack (DataLoader calls `__getitems__` with the batch's indices when a dataset has it)."""

    def __init__(self, dataset: TensorDataset):
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> tuple:
        index = torch.as_tensor(indices)
        return tuple(t[index] for t in self.tensors)


def _already_batched(batch: tuple) -> tuple:
    return batch


def make_loader(dataset: Dataset, batch_size: int, *, seed: int, shuffle: bool, num_workers: int,
                pin_memory: bool, rank: int = 0, world: int = 1) -> DataLoader:
    # Evaluation shards without padding so reduced metrics equal a single-process pass.
    sampler = EpochSampler(len(dataset), seed, shuffle, rank, world, pad=shuffle)
    collate = None
    if isinstance(dataset, TensorDataset):
        dataset, collate = BatchedTensors(dataset), _already_batched
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, collate_fn=collate,
                      pin_memory=pin_memory, drop_last=False, persistent_workers=num_workers > 0,
                      # an own generator: creating an iterator must not consume the global RNG,
                      # or a resumed run's dropout stream would differ from an uninterrupted one
                      generator=torch.Generator().manual_seed(seed))


def micro_batches_per_epoch(loader: DataLoader) -> int:
    return math.ceil(loader.sampler.per_rank() / loader.batch_size)


def optimizer_steps(loader: DataLoader, accum: int) -> Iterator[list]:
    """Group the loader's micro-batches N at a time; the epoch's last group may hold fewer."""
    group: list = []
    for batch in loader:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []
    if group:
        yield group
