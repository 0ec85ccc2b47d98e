"""Regression: mean squared error over samples (targets [B] or [B, k]); mean absolute error as a metric."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runner.tasks import Task

if TYPE_CHECKING:
    import torch


class Regression(Task):
    metrics = {"loss": "minimize", "mae": "minimize"}

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F  # here, not at the top: see runner/tasks/__init__.py

        prediction = logits.float().reshape(labels.shape)
        return F.mse_loss(prediction, labels.float(), reduction="sum") / _per_sample(labels)

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch.nn.functional as F

        prediction = logits.float().reshape(labels.shape)
        per = _per_sample(labels)
        return {"loss": F.mse_loss(prediction, labels.float(), reduction="sum") / per,
                "mae": F.l1_loss(prediction, labels.float(), reduction="sum") / per}


def _per_sample(labels: torch.Tensor) -> int:
    return max(labels[0].numel(), 1) if labels.dim() > 1 and len(labels) else 1
