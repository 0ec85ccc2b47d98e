"""A user's language-modelling data: random token sequences whose labels are partly padding (-100)."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

from runner.data.splits import DataSplits


class PaddedSequences(Dataset):
    def __init__(self, n: int, length: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, length + 1), generator=g)
        # a ragged tail per sequence: 0..length/2 trailing label positions count for nothing
        self.keep = length - torch.randint(0, length // 2 + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        x, y = self.tokens[i, :-1], self.tokens[i, 1:].clone()
        y[int(self.keep[i]):] = -100
        return {"input_ids": x, "labels": y}


def build(size: int = 90, length: int = 16, vocab: int = 50, split_seed: int = 0) -> DataSplits:
    splits = [PaddedSequences(n, length, vocab, split_seed + k) for k, n in enumerate((size, size // 5, size // 5))]
    return DataSplits(*splits, input_shape=(length,), vocab_size=vocab, max_length=length)
