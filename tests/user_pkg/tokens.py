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


class RaggedSequences(Dataset):
    """Token sequences of random lengths from length // 3 to length, batched by `pad_batch` to the longest of
    each batch: the FLOP count must follow each batch's own length (tests/runner/engine/test_flops.py)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, vocab, (n, length + 1), generator=g)
        self.lengths = torch.randint(length // 3, length + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        return {"input_ids": self.tokens[i, :n], "labels": self.tokens[i, 1:n + 1]}


def pad_batch(items: list[dict]) -> dict:
    """input_ids padded with 0 and labels with -100 (not counted) to the batch's longest sequence."""
    from torch.nn.utils.rnn import pad_sequence

    return {"input_ids": pad_sequence([i["input_ids"] for i in items], batch_first=True, padding_value=0),
            "labels": pad_sequence([i["labels"] for i in items], batch_first=True, padding_value=-100)}


def build_ragged(size: int = 96, length: int = 24, vocab: int = 50, split_seed: int = 0) -> DataSplits:
    splits = [RaggedSequences(n, length, vocab, split_seed + k) for k, n in enumerate((size, size // 4, size // 4))]
    return DataSplits(*splits, input_shape=(length,), vocab_size=vocab, max_length=length, pad_token_id=0,
                      collate=pad_batch)
