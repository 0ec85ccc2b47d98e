"""Activation checkpointing (`trainer.activation_checkpointing`) on the model's repeated blocks: the
children of its Sequentials/ModuleLists that FSDP shards one by one (runner/engine/parallel/wrap.py's shard_blocks),
so a user's model marks its blocks the same way for both.

- none: every activation is kept for the backward pass.
- full: a block keeps only its inputs; its forward runs again in the backward pass (about one more
  forward per step, the least memory).
- selective: a block keeps the outputs of its matrix multiplications (but an MLP's wide up-projection),
  convolutions and attention, the operations that cost compute, and recomputes the rest (norms,
  activations, dropout, additions):
  torch's selective activation checkpointing (create_selective_checkpoint_contexts). It costs little
  step time because only cheap elementwise work is done twice; it saves less memory than full.
  A block holding BatchNorm is checkpointed fully instead: its replay must put BatchNorm's running
  statistics back as the forward left them, which a selective replay cannot (it may not touch tensors).

Both are non-reentrant torch.utils.checkpoint: the recomputation replays the random state, so
dropout masks and therefore loss and gradients equal the run without checkpointing, to the bit.
The wrapping changes no parameter name: state dicts, checkpoints and optimizer groups stay the same.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from runner.specs.run import SpecError

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# the compute-heavy operations selective checkpointing keeps (their outputs); everything else is recomputed
SAVED_OPS = frozenset({
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention, _aten._scaled_dot_product_flash_attention_for_cpu,
})


# An MLP's up-projection (a matmul whose output is more than 3x wider than its input, 4x in GPT-style
# blocks) is recomputed even so: its output is the widest activation of a transformer block, and keeping
# it left 71% of the activations (make bench-memory, small GPT); recomputing it, one third of the block's
# matmul work, brings selective to 49%. Attention's fused qkv (exactly 3x) and SwiGLU's gate and up
# projections (8/3x) stay kept.
UP_PROJECTION = 3


def _keep_compute_heavy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    packet = op.overloadpacket
    if packet not in SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if packet in (_aten.mm, _aten.addmm):
        a, b = args[-2], args[-1]  # mm(a, b), addmm(bias, a, b)
        if b.shape[-1] > UP_PROJECTION * a.shape[-1]:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def selective_contexts():
    return create_selective_checkpoint_contexts(_keep_compute_heavy)


def apply(module: nn.Module, mode: str) -> nn.Module:
    """Checkpoints each of `module`'s blocks in place (before any DDP/FSDP wrap or compile); returns it."""
    if mode == "none":
        return module
    from runner.engine.parallel import shard_blocks

    try:
        blocks = shard_blocks(module)
    except SpecError:
        raise SpecError(f"trainer.activation_checkpointing: {mode} found no repeated blocks in {type(module).__name__} "
                        "(no child module with parameters in a Sequential or ModuleList); use "
                        "trainer.activation_checkpointing=none") from None
    for block in blocks:
        _checkpoint_block(block, mode)
    return module


def checkpointed_blocks(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, _Checkpointed)]


class _Checkpointed:
    """Mixed into a block's own class (as FSDP2's fully_shard does), so its forward, hooks, parameter
    names and isinstance checks stay the block's."""

    _checkpoint_mode = "full"

    def forward(self, *args, **kwargs):
        forward = super().forward
        norms = [m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if self._checkpoint_mode == "selective" and not norms:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
        updating = [m for m in norms if m.training and m.track_running_stats]
        if updating and not torch.compiler.is_compiling():
            forward = _once_updating_stats(forward, updating)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _once_updating_stats(forward, norms: list[nn.Module]):
    """The recomputation runs the block's BatchNorms in training mode again, which would move their
    running statistics a second time: they are put back as the forward pass left them."""
    calls = []

    def run(*args, **kwargs):
        if not calls:
            calls.append(True)
            return forward(*args, **kwargs)
        kept = [(b, b.clone()) for m in norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
                if b is not None]
        try:  # finally: the checkpoint may stop a recomputation early, as soon as it has what it needs
            return forward(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)

    return run


@functools.cache
def _checkpointed_class(cls: type, mode: str) -> type:
    return type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {"_checkpoint_mode": mode})


def _checkpoint_block(block: nn.Module, mode: str) -> None:
    block.__class__ = _checkpointed_class(type(block), mode)
