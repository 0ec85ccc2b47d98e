"""A user's pipeline plan (parallelism.pp_plan={_target_: tests.user_pkg.stages.mlp_stage}) for a Sequential."""
from __future__ import annotations

from torch import nn


def mlp_stage(model: nn.Sequential, stage_index: int, num_stages: int) -> nn.Module:
    """Consecutive layers of a Sequential; the others become nn.Identity, so the names stay the model's."""
    layers = list(model)
    start, stop = (len(layers) * i // num_stages for i in (stage_index, stage_index + 1))
    return nn.Sequential(*(layer if start <= i < stop else nn.Identity() for i, layer in enumerate(layers)))


def blocks_stage(model: nn.Module, stage_index: int, num_stages: int, blocks: str = "layers") -> nn.Module:
    """The model's blocks (a ModuleList named by `blocks`) cut into consecutive stages, the model's other parts
    kept: a plan written for another model (its blocks named `layers`) names a part this one may not hold."""
    import copy

    layers = model.get_submodule(blocks)
    start, stop = (len(layers) * i // num_stages for i in (stage_index, stage_index + 1))
    stage = copy.copy(model)
    stage._modules = dict(model._modules)
    setattr(stage, blocks, nn.ModuleList(b if start <= i < stop else nn.Identity() for i, b in enumerate(layers)))
    return stage
