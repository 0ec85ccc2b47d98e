"""A user's own optimizer, schedule and loss, named only by `_target_` (conf/ here, or the command line)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.tasks import Classification


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolation of momentum and gradient, decoupled weight decay."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"betas: {list(betas)} is not allowed; each must be >= 0 and < 1")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(momentum * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                momentum.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def halving(step: int, every: int = 10) -> float:
    """The lr factor at `step`: halved every `every` optimizer steps."""
    if every < 1:
        raise ValueError(f"every: {every} is not allowed; give a number of optimizer steps >= 1")
    return 0.5 ** (step // every)


class FocalLoss(Classification):
    """Cross-entropy that down-weights confident predictions by (1 - p)^gamma (Lin et al. 2017)."""

    def __init__(self, gamma: float = 2.0, num_classes: int | None = None) -> None:
        if gamma < 0:
            raise ValueError(f"gamma: {gamma} is not allowed; give a number >= 0")
        super().__init__(0.0, num_classes)
        self.gamma = gamma

    def loss_sum(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(output.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        return -((1 - log_p.exp()) ** self.gamma * log_p).sum()


class LowAccuracyFirst(Classification):
    """Classification with accuracy declared better when lower: the tests' way to make a run's best validation
    of val/acc an early one (accuracy rises as it trains), so that its best and last weights differ."""

    metrics = {**Classification.metrics, "acc": "minimize"}
