"""Language modelling: next-token cross-entropy averaged over every token that is not padding (labels
-100), exactly, across micro-batches and ranks; perplexity. Labels are already the next tokens (the
data shifts them)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from runner.tasks import IGNORE, Task, units_kept

if TYPE_CHECKING:
    import torch


class LanguageModeling(Task):
    metrics = {"loss": "minimize", "ppl": "minimize"}
    unit = "tokens"

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def count(self, labels: torch.Tensor) -> int | torch.Tensor:
        return units_kept(labels)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F  # here, not at the top: see runner/tasks/__init__.py

        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=IGNORE,
                               label_smoothing=self.label_smoothing)

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch.nn.functional as F

        return {"loss": F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum",
                                        ignore_index=IGNORE)}

    def summarize(self, sums: dict[str, float], count: float) -> dict[str, float]:
        loss = sums["loss"] / count
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}

    def loss_options(self) -> dict[str, Any]:
        return {"label_smoothing": self.label_smoothing} if self.label_smoothing else {}
