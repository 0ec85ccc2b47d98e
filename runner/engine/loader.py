"""Data loaders whose order depends on (seed, epoch) alone, that deal samples to ranks without
repeating any, and that can start mid-epoch.

torch's DistributedSampler pads a shard by repeating samples so that every rank sees as many, which
makes N ranks differ from one process whenever the dataset size does not divide by N, and it cannot
start at a position. Here each epoch's order is cut into global micro-batches of batch x dp degree
samples, and each global micro-batch is dealt across the data-parallel replicas in turn: every replica
gets the same number of micro-batches (so collectives stay in step), a replica may get one sample fewer,
or none, in the epoch's last micro-batch (it then gets an EmptyShare, which counts nothing), and no
sample is seen twice. The step's loss is normalised by the sample count reduced across replicas
(runner/engine/engine.py), so N replicas at batch B equal one process at batch N*B for any dataset size.
Ranks of one replica (model parallelism) share its dp rank, and so its samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate


class EpochBatches(Sampler[list[int]]):
    """One data-parallel replica's micro-batches (lists of indices) of one epoch."""

    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool, dp_rank: int = 0, dp_degree: int = 1,
                 keyed: bool = False):
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        # a dataset whose items are random (augmentation) gets (index, seed) keys: an item's randomness then
        # depends on (run seed, epoch, index) alone, not on which worker reads it or whether the run resumed
        self.keyed = keyed
        self.epoch, self.start = 0, 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.dp_degree

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Order of `epoch`, skipping the first `start` samples of it (all replicas together)."""
        self.epoch, self.start = epoch, start

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for begin in range(self.start, self.size, self.global_batch):
            part = order[begin:begin + self.global_batch][self.dp_rank::self.dp_degree]
            yield [(i, self._sample_seed(i)) for i in part] if self.keyed else part

    def _sample_seed(self, index: int) -> int:
        # splitmix64's finaliser: every input bit reaches the low 32 bits, the only ones torch's CPU
        # generator (mt19937) seeds from
        x = (self.seed * 0x9E3779B97F4A7C15 + self.epoch * 0xBF58476D1CE4E5B9 + index) % 2**64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
        return (x ^ (x >> 31)) % 2**63

    def __len__(self) -> int:
        return math.ceil(max(self.size - self.start, 0) / self.global_batch)

    def batches_per_epoch(self) -> int:
        return math.ceil(self.size / self.global_batch)


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
        # may be empty: a rank's share of the last batch; on the tensors' device (a GPU-resident dataset)
        index, device = torch.as_tensor(indices, dtype=torch.long), self.tensors[0].device
        if device.type == "cuda":
            # Through pinned memory, without blocking: building the index on the GPU from a list copies from
            # pageable memory, which waits for every kernel queued before it. That wait each step left the H100
            # idle while the next forward was launched (11% of the GPT-2 step, make bench-gpu).
            index = index.pin_memory().to(device, non_blocking=True)
        return tuple(t[index] for t in self.tensors)


@dataclass(frozen=True)
class EmptyShare:
    """A rank's empty share of a global micro-batch, carrying `stand_in`: the first real samples of the
    dataset, collated like any batch. The engine forwards it (the rank must join the step's
    collectives) and counts it as nothing; no label is altered to mean "no sample"."""

    stand_in: Any


class Collate:
    """The dataset's collate (torch's default when it has none; a tensor dataset's batches arrive
    gathered), and for a rank whose share of the epoch's last batch is empty, an EmptyShare."""

    def __init__(self, dataset: Dataset, collate: Callable | None, keyed: bool = False):
        self.dataset, self.collate, self.keyed = dataset, collate or default_collate, keyed

    def __call__(self, items: Any) -> Any:
        if isinstance(self.dataset, BatchedTensors):
            return items if len(items[0]) else self.stand_in()
        return self.collate(items) if items else self.stand_in()

    def stand_in(self) -> EmptyShare:
        # two samples where there are: a BatchNorm1d in training refuses a batch of one; read by (index,
        # seed) where the dataset takes keys, so the stand-in draws nothing from the run's RNG
        n = min(2, len(self.dataset))
        if isinstance(self.dataset, BatchedTensors):
            return EmptyShare(self.dataset.__getitems__(list(range(n))))
        return EmptyShare(self.collate([self.dataset[(i, 0) if self.keyed else i] for i in range(n)]))


def on_device(dataset: Dataset, device: torch.device, budget: float = 0.25) -> Dataset:
    """A small tensor dataset moved onto the accelerator once, when it takes at most `budget` of its
    free memory: batches are then gathered there, with no host-to-device copy per step."""
    if device.type != "cuda" or not isinstance(dataset, TensorDataset) or not fits(dataset, device, budget):
        return dataset
    return TensorDataset(*(t.to(device) for t in dataset.tensors))


def fits(dataset: TensorDataset, device: torch.device, budget: float) -> bool:
    size = sum(t.numel() * t.element_size() for t in dataset.tensors)
    free, _ = torch.cuda.mem_get_info(device)
    return size <= budget * free


def make_loader(dataset: Dataset, batch_size: int, *, seed: int, shuffle: bool, num_workers: int,
                pin_memory: bool, dp_rank: int = 0, dp_degree: int = 1, collate: Callable | None = None) -> DataLoader:
    if isinstance(dataset, TensorDataset) and dataset.tensors and dataset.tensors[0].is_cuda:
        num_workers, pin_memory = 0, False  # already on the device: gathered in this process
    batches = EpochBatches(len(dataset), batch_size, seed, shuffle, dp_rank, dp_degree,
                           keyed=bool(getattr(dataset, "takes_sample_seeds", False)))
    if isinstance(dataset, TensorDataset) and collate is None:
        dataset = BatchedTensors(dataset)
    if len(dataset):
        collate = Collate(dataset, collate, batches.keyed)
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers, collate_fn=collate,
                      pin_memory=pin_memory, persistent_workers=num_workers > 0,
                      # an own generator: creating an iterator must not consume the global RNG,
                      # or a resumed run's dropout stream would differ from an uninterrupted one
                      generator=torch.Generator().manual_seed(seed))


def optimizer_steps(loader: DataLoader, accum: int) -> Iterable[Sequence]:
    """Group the loader's micro-batches N at a time; the epoch's last group may hold fewer. One at a time: each
    batch in a tuple of its own, made in C (a generator's resume costs a tiny step ~1.5k instructions)."""
    return zip(loader) if accum == 1 else _groups(loader, accum)


def _groups(loader: DataLoader, accum: int) -> Iterator[list]:
    group: list = []
    for batch in loader:
        group.append(batch)
        if len(group) == accum:
            yield group
            group = []
    if group:
        yield group
