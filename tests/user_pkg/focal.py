"""A user's loss: focal loss for classification (Lin et al. 2017), written as a runner task."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.tasks import Task


class FocalLoss(Task):
    metrics = {"loss": "minimize", "acc": "maximize"}  # logged as val/loss, val/acc, test/...

    def __init__(self, gamma: float = 2.0):
        self.gamma = gamma

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)
        return -((1 - log_p.exp()) ** self.gamma * log_p).sum()

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.loss_sum(logits, labels), "acc": (logits.argmax(dim=-1) == labels).sum()}

    def loss_options(self) -> dict:
        return {"gamma": self.gamma}  # a model that computes its own loss would make gamma do nothing
