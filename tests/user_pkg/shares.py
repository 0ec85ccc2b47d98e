"""A user's data and model for every path a rank's empty share of a batch takes: a map-style dataset (not
a tensor dataset) with its own collate, tuple or dict batches, class ids or real-valued targets,
optional mixup, and a model that computes its own loss (it returns no logits, so the task cannot)."""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from runner.data.splits import DataSplits
from runner.data.transforms import batch_mixing


class Samples(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, layout: str):
        self.x, self.y, self.layout = x, y, layout

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return {"features": self.x[i], "labels": self.y[i]} if self.layout == "dict" else (self.x[i], self.y[i])


def collate(items: list):
    """The user's own collate: stacks each field (a tuple or a dict per item)."""
    if isinstance(items[0], dict):
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}
    return tuple(torch.stack(field) for field in zip(*items))


def build(sizes: tuple[int, int, int] = (25, 9, 9), features: int = 6, classes: int = 3,
          targets: Literal["classes", "values"] = "classes", layout: Literal["tuple", "dict"] = "tuple",
          mixup_alpha: float = 0.0, seed: int = 0) -> DataSplits:
    """Train, val and test splits of `sizes` samples: 25, 9 and 9 leave the second of two ranks an empty
    share of each split's last batch at batch_size 4."""
    g = torch.Generator().manual_seed(seed)
    size = sum(sizes)
    x = torch.randn(size, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w).argmax(dim=1) if targets == "classes" else x @ w + 0.1 * torch.randn(size, classes, generator=g)
    shape = (features,)
    if mixup_alpha:  # torchvision's mixup takes image batches [B, C, H, W]
        shape = (1, 1, features)
        x = x.reshape(size, *shape)
    ends = [sizes[0], sizes[0] + sizes[1], size]
    parts = [Samples(x[a:b], y[a:b], layout) for a, b in zip([0, *ends[:2]], ends)]
    return DataSplits(*parts, input_shape=shape, num_classes=classes, collate=collate,
                      batch_transform=batch_mixing(classes, mixup_alpha) if mixup_alpha else None)


class OwnLossNet(nn.Module):
    """Given labels, returns its own loss in a plain dict: the mean over the batch's samples, as the task's
    unit is. With `returns=loss` that is all it returns, so the task cannot compute the loss; with
    `returns=logits_and_loss` its logits come too (as a HuggingFace model's do), and the task's loss wins."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16,
                 returns: Literal["loss", "logits_and_loss"] = "loss"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(input_shape[0], width), nn.Tanh(), nn.Linear(width, num_classes))
        self.returns = returns

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.body(features)
        if labels is None:
            return {"logits": logits}
        loss = F.cross_entropy(logits, labels) + 0.1 * logits.pow(2).mean()
        return {"loss": loss} if self.returns == "loss" else {"logits": logits, "loss": loss}
