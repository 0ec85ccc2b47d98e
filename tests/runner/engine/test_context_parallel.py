"""Context parallelism's sharding (runner/engine/parallel/context.py) on two gloo processes: each rank's
token ids, labels and positions are the same load-balanced share of every sequence, the shares cover the
sequence once, the engine's batch is left whole, and the shares' gradients and loss sums add up over the
cp ranks. The ring attention itself needs CUDA and is not run
here (no GPU in CI); its refusal on a CPU is tested in tests/runner/specs/test_parallelism.py."""
from __future__ import annotations

import torch


def _shard(rank: int, world: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    from runner.engine.parallel import context
    from runner.tasks import Batch

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    tokens = torch.arange(8).repeat(3, 1)
    batch = Batch(tokens, tokens + 100)
    with context.for_step(mesh["cp"], batch) as shard:
        got = (shard.inputs["input_ids"].tolist(), shard.inputs["positions"].tolist(), shard.labels.tolist())
    layer = torch.nn.Linear(2, 1)
    layer.weight.grad = torch.full((1, 2), float(rank + 1))  # each rank's gradient of its share
    context.sum_gradients(layer, mesh["cp"])
    return (rank, *got, batch.inputs.tolist() == tokens.tolist(), batch.labels.tolist() == (tokens + 100).tolist(),
            layer.weight.grad.tolist(), layer.bias.grad, context.whole_sequence(torch.tensor(rank + 1.0), mesh["cp"]).item())


def test_tokens_labels_and_positions_are_sharded_alike_and_the_shares_gradients_and_losses_add_up(two_ranks) -> None:
    got = two_ranks.run(_shard)
    # causal load balancing: 4 chunks of 2 tokens, rank 0 the first and last, rank 1 the middle two
    assert got == [(0, [[0, 1, 6, 7]] * 3, [0, 1, 6, 7], [[100, 101, 106, 107]] * 3, True, True, [[3.0, 3.0]], None, 3.0),
                   (1, [[2, 3, 4, 5]] * 3, [2, 3, 4, 5], [[102, 103, 104, 105]] * 3, True, True, [[3.0, 3.0]], None, 3.0)]
