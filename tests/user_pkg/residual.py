"""A user's residual models with their own pipeline_stage: one adds the residual inside its blocks (pipeline
stages compute its forward), the other in its own forward, outside the blocks (a stage without a block would
add x + x: runner refuses it, runner/engine/parallel/pipeline_checks.py)."""
from __future__ import annotations

import math

from torch import nn


class Inner(nn.Module):
    """x + f(x), inside the block."""

    def __init__(self, width: int):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x):
        return x + self.f(x)


class _Net(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16, depth: int = 2):
        super().__init__()
        self.embed = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width))
        self.blocks = nn.ModuleList(self.block(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def pipeline_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        """Consecutive blocks; the embedding in the first stage, the head in the last (None elsewhere)."""
        depth = len(self.blocks)
        if not 0 < num_stages <= depth:
            raise ValueError(f"num_stages: {num_stages} stages cannot be cut from {depth} blocks; allowed: 1 to {depth}")
        start, stop = depth * stage_index // num_stages, depth * (stage_index + 1) // num_stages
        stage = object.__new__(type(self))  # shares every part; its own parts can be replaced
        stage.__dict__ = {**self.__dict__, "_modules": dict(self._modules)}
        stage.blocks = nn.ModuleList(b if start <= i < stop else nn.Identity() for i, b in enumerate(self.blocks))
        if stage_index > 0:
            stage.embed = None
        if stage_index < num_stages - 1:
            stage.head = None
        return stage


class InnerResidual(_Net):
    """Each block adds its own residual: the forward passes only each block's output on."""

    @staticmethod
    def block(width: int) -> nn.Module:
        return Inner(width)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


class OuterResidual(_Net):
    """The forward adds each block's residual, outside the block."""

    @staticmethod
    def block(width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return x if self.head is None else self.head(x)


class ReadsValues(InnerResidual):
    """A forward that reads its input's values (a data-dependent branch): the meta device cannot trace it."""

    def forward(self, x):
        if x.abs().sum() > 0:
            return super().forward(x)
        return super().forward(x)


class OuterResidualReadsOnBuild(OuterResidual):
    """OuterResidual whose constructor reads a value (its head's initial norm), which the meta device cannot give:
    it is built whole, and its composition must still be checked before anything starts."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16, depth: int = 2):
        super().__init__(input_shape, num_classes, width, depth)
        self.initial_head_norm = float(self.head.weight.detach().norm())
