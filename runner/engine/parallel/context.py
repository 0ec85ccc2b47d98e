"""Context parallelism: each sequence split across the cp ranks of one model replica, attention computed
as ring attention over the shards (torch.distributed.tensor.experimental.context_parallel, which patches
scaled_dot_product_attention while its context is open). For a sequence too long for one device's
attention activations; gpt's attention is SDPA, so gpt is the built-in model it serves.

What a model must offer: a forward that takes `positions` (the sequence positions of the tokens it is
given, models/gpt.py). Under CP a rank holds a load-balanced, not contiguous, share of each sequence,
so the positions are sharded with the tokens and the labels, never recomputed from the local length.

The loss stays normalised by the step's global unit count: the engine counts the units of the whole
batch before the batch is sharded (every cp rank of a data-parallel replica counts the same tokens, and
the count is reduced over the data-parallel group only), and each cp rank's loss sum covers its share
of them. The gradient of the replica's loss is then the sum of its cp ranks' gradients: `sum_gradients`
adds them up over the cp group once the step's last backward is done (the data-parallel wrap, over
dp_replicate/dp_shard only, averages across replicas as without CP; every cp rank of one dp_shard index
holds the same shard, so summing the local shards is exact).

The engine's train step needs, where its micro-batches run (ring attention's backward runs under the
same patch as its forward, so `for_step` wraps both):

    self.cp_mesh = self.env.submesh("cp")                   # Engine.__init__; None without CP
    context.check_model(self.model, spec.model.target)      # Engine.__init__, when self.cp_mesh is set
    with context.for_step(self.cp_mesh, batch) as batch:    # train_step: around forward, loss sum, backward
    context.sum_gradients(self.model, self.cp_mesh)         # train_step: after the loop, before clipping
    loss_sum = context.whole_sequence(loss_sum, self.cp_mesh)  # train_step: the logged loss, every share
Evaluation may run without it (each cp rank then computes the whole sequence: correct, no memory saved).

This cannot run on a CPU (torch's CP attention is CUDA-only): the CPU refusal is `check_context_parallel`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import typing
from typing import Any, Iterator

import torch

from runner.specs.fields import SpecError

POSITIONS = "positions"  # the keyword a CP-able model's forward takes


def has_context_parallel() -> bool:
    """Whether this torch has the context-parallel attention (torch >= 2.6, distributed built in)."""
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        return False
    return True


def takes_positions(fn: Any) -> bool | None:
    """Whether a model (a class, an instance, or a builder) takes `positions` in its forward; None when a
    builder's model is only known once built."""
    forward = getattr(fn, "forward", None)
    if forward is None and callable(fn):  # a builder: the forward of the class it declares it returns
        try:
            forward = getattr(typing.get_type_hints(fn).get("return"), "forward", None)
        except Exception:  # an annotation that does not resolve here says nothing
            forward = None
    if forward is None:
        return None
    try:
        return POSITIONS in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None


def check_context_parallel(spec: Any, device: torch.device, model_target: Any = None) -> None:
    """parallelism.cp > 1 where it cannot run, refused in one line before anything starts: not CUDA, a
    torch without context_parallel, a model whose forward takes no `positions`."""
    cp = spec.parallelism.cp
    if cp == 1:
        return
    if device.type != "cuda":
        raise SpecError(f"parallelism.cp: {cp}, but context parallelism needs CUDA (torch's context-parallel "
                        f"attention runs on GPUs) and this run's device is {device.type}; use a GPU "
                        "(trainer.device=cuda) or parallelism.cp=1")
    if not has_context_parallel():
        raise SpecError(f"parallelism.cp: {cp}, but torch {torch.__version__} lacks context parallelism "
                        "(torch.distributed.tensor.experimental.context_parallel, torch >= 2.6); upgrade torch "
                        "or use parallelism.cp=1")
    if model_target is None:
        from runner.specs import components

        model_target = components.load_target("model", spec.model.target)
    if takes_positions(model_target) is False:
        raise SpecError(f"parallelism.cp: {cp}, but model {spec.model.target} has no context-parallel attention "
                        f"(its forward takes no `{POSITIONS}` to shard with the tokens); use model=gpt or "
                        "parallelism.cp=1")


def check_model(model: torch.nn.Module, target: str) -> None:
    """The built model (a builder's, known only now) takes `positions`."""
    if not takes_positions(model):
        raise SpecError(f"parallelism.cp: model {target} has no context-parallel attention (its forward takes "
                        f"no `{POSITIONS}` to shard with the tokens); use model=gpt or parallelism.cp=1")


@contextlib.contextmanager
def for_step(cp_mesh: Any, batch: Any) -> Iterator[Any]:
    """The micro-batch this rank computes on. Without CP (cp_mesh None) the batch itself. Under CP: copies
    of its token ids and labels, and their positions, sharded along the sequence on `cp_mesh` (torch's
    load balancing: with 2 ranks, rank 0 holds the first and last quarter), the inputs given as
    {"input_ids", "positions"}, and SDPA dispatched to ring attention while the context is open. The
    batch given is left as it was."""
    if cp_mesh is None or getattr(batch, "empty", False):
        yield batch
        return
    from torch.distributed.tensor.experimental import context_parallel

    inputs = batch.inputs
    input_ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
    length, cp = input_ids.shape[1], cp_mesh.size()
    if length % (2 * cp):  # the causal load balancer cuts each sequence into 2 x cp chunks
        raise SpecError(f"parallelism.cp: {cp} splits each sequence into {2 * cp} chunks, but a batch holds "
                        f"sequences of {length} tokens; use a sequence length divisible by {2 * cp}")
    # copies: the sharding resizes its buffers in place, and a batch may be a view of the dataset's tensor
    input_ids, labels = input_ids.clone(memory_format=torch.contiguous_format), batch.labels.clone(
        memory_format=torch.contiguous_format)
    positions = torch.arange(length, device=input_ids.device)
    extra = {k: v for k, v in inputs.items() if k != "input_ids"} if isinstance(inputs, dict) else {}
    extra.pop("attention_mask", None)  # causal attention ignores right padding (see models/gpt.py)
    with context_parallel(cp_mesh, buffers=[input_ids, labels, positions], buffer_seq_dims=[1, 1, 0],
                          no_restore_buffers={input_ids, labels, positions}):
        yield dataclasses.replace(batch, inputs={**extra, "input_ids": input_ids, POSITIONS: positions},
                                  labels=labels)


def whole_sequence(loss_sum: torch.Tensor, cp_mesh: Any) -> torch.Tensor:
    """A rank's loss sum over its share of the sequences, summed over the cp ranks: the replica's (for the
    log; the gradient already covers every share through the wrap's reduction)."""
    if cp_mesh is None:
        return loss_sum
    import torch.distributed as dist

    total = loss_sum.clone()
    dist.all_reduce(total, group=cp_mesh.get_group())
    return total


def sum_gradients(model: torch.nn.Module, cp_mesh: Any) -> None:
    """Each parameter's gradient summed over the cp ranks (each computed it from its share of the
    sequences); a sharded (DTensor) gradient by its local shard, which the cp ranks hold alike."""
    if cp_mesh is None:
        return
    import torch.distributed as dist

    group = cp_mesh.get_group()
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)
