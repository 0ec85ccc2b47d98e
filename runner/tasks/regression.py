"""Regression: mean squared error over samples (targets [B] or [B, k]); mean absolute error as a metric."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runner.tasks import Task, functional

if TYPE_CHECKING:
    import torch


class Regression(Task):
    metrics = {"loss": "minimize", "mae": "minimize"}

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        F = functional()  # torch's, imported once, not at the top: see runner/tasks/__init__.py

        prediction = logits.float().reshape(labels.shape)
        return F.mse_loss(prediction, labels.float(), reduction="sum") / _per_sample(labels)

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch.nn.functional as F

        prediction = logits.float().reshape(labels.shape)
        per = _per_sample(labels)
        return {"loss": F.mse_loss(prediction, labels.float(), reduction="sum") / per,
                "mae": F.l1_loss(prediction, labels.float(), reduction="sum") / per}

    def prediction_rows(self, logits: torch.Tensor, labels: torch.Tensor | None) -> list[dict[str, Any]]:
        """The predicted value (a list of values for several outputs), and the target where labels are given."""
        values = logits.detach().float().reshape(len(logits), -1).cpu()
        targets = None if labels is None else labels.detach().float().reshape(len(labels), -1).cpu()
        rows = []
        for i, v in enumerate(values):
            row = {"predicted": _plain(v)}
            if targets is not None:
                row["target"] = _plain(targets[i])
            rows.append(row)
        return rows


def _plain(values: torch.Tensor) -> float | list[float]:
    return float(values[0]) if len(values) == 1 else [float(v) for v in values]


def _per_sample(labels: torch.Tensor) -> int:
    return max(labels[0].numel(), 1) if labels.dim() > 1 and len(labels) else 1
