"""A user's tensor-parallel plan, named as `parallelism.tp_plan={_target_: tests.user_pkg.plans.column_then_row}`:
fn(model, tp_mesh, **params) splits the model in place with torch.distributed.tensor.parallel."""
from __future__ import annotations


def column_then_row(model, tp_mesh, column: str = "1", row: str = "3") -> None:
    """Megatron's pair for an MLP (runner's mlp with one hidden layer: Flatten, Linear, ReLU, Linear): the first
    Linear split by output features, the second by input features, its output all-reduced."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {column: ColwiseParallel(), row: RowwiseParallel()})
