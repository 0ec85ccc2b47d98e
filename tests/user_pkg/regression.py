"""A user's regression data (noisy linear targets, two outputs per sample) and a task that reports R^2."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from runner.data.splits import DataSplits
from runner.tasks import Task


def build(size: int = 200, features: int = 6, outputs: int = 2, seed: int = 0) -> DataSplits:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, features, generator=g)
    y = x @ torch.randn(features, outputs, generator=g) + 0.1 * torch.randn(size, outputs, generator=g)
    cut = [int(size * 0.7), int(size * 0.85)]
    parts = [TensorDataset(x[a:b], y[a:b]) for a, b in ((0, cut[0]), (cut[0], cut[1]), (cut[1], size))]
    return DataSplits(*parts, input_shape=(features,), num_classes=outputs)


class R2Regression(Task):
    """Mean squared error, and the coefficient of determination R^2 of one output (higher is better)
    from sums that add up over batches and ranks."""

    metrics = {"loss": "minimize", "r2": "maximize"}

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(logits.float().reshape(labels.shape), labels.float(), reduction="sum")

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        y = labels.float()
        return {"loss": self.loss_sum(logits, labels), "y": y.sum(), "y2": (y * y).sum(),
                "sse": ((logits.float().reshape(y.shape) - y) ** 2).sum()}

    def summarize(self, sums: dict, count: float) -> dict[str, float]:
        sst = sums["y2"] - sums["y"] ** 2 / count
        return {"loss": sums["loss"] / count, "r2": 1 - sums["sse"] / sst}
