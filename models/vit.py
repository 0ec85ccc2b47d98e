"""A small vision transformer sized for 32x32 images (CIFAR, MNIST padded or not).

The defaults (patch 4, dim 192, depth 6, 3 heads) give 64 patches per 32x32 image and ~2.7M parameters:
ViT-Tiny's width on a sequence short enough to train on one GPU in minutes. The encoder block is
written here rather than taken from nn.TransformerEncoderLayer so attention goes straight to
`scaled_dot_product_attention` (flash / memory-efficient kernels) with the same pre-norm layout as gpt.py.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # (B, N, 3C) -> three (B, heads, N, C / heads) tensors, the layout SDPA expects; under tensor parallelism
        # qkv gives this rank's [q | k | v] of its own `heads` heads (parallelize_tensor)
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, -1)))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class ViT(nn.Module):
    """Images (B, C, H, W) -> class logits (B, num_classes), classifying from a class token."""

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...] = (3, 32, 32),
        patch_size: int = 4,
        dim: int = 192,
        depth: int = 6,
        heads: int = 3,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"input_shape: {tuple(input_shape)} is not an image; allowed: (channels, height, width)")
        channels, height, width = input_shape
        for name, value in (("num_classes", num_classes), ("patch_size", patch_size), ("dim", dim),
                            ("depth", depth), ("heads", heads)):
            if value < 1:
                raise ValueError(f"{name}: {value} is too small; allowed: an integer >= 1")
        if height % patch_size or width % patch_size:
            divisors = [p for p in range(1, min(height, width) + 1) if height % p == 0 and width % p == 0]
            raise ValueError(f"patch_size: {patch_size} does not divide the {height}x{width} image; "
                             f"allowed: {', '.join(map(str, divisors))}")
        if dim % heads:
            raise ValueError(f"dim: {dim} is not divisible by heads={heads}; allowed: a multiple of {heads}")
        if mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio: {mlp_ratio} is not positive; allowed: mlp_ratio > 0")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: {dropout} is out of range; allowed: 0 <= dropout < 1")
        patches = (height // patch_size) * (width // patch_size)

        # a stride=kernel conv is the patch split and the linear projection in one op
        self.patch_embed = nn.Conv2d(channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, dim))
        self.drop = nn.Dropout(dropout)
        # a ModuleList: the engine's FSDP wrapping shards each child of it as its own unit
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, mlp_ratio, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        # small truncated-normal init as in the ViT paper's reference code; torch's fan-in default for
        # the wide MLP layers starts the residual stream noisier and trains slower from scratch
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def parallelize_tensor(self, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
        """Tensor parallelism across tp_mesh (runner/engine/parallel/tensor.py), in place: each rank computes
        heads / tp heads (qkv by columns, its projection back by rows) and a 1 / tp slice of the MLP; the
        patch embedding, the final norm and the classifier head are replicated. sequence_parallel: the norms,
        dropouts and the residual stream hold 1 / tp of the patches (any count: the stream stays a DTensor).
        loss_parallel has nothing to split here (the head's classes are few) and changes nothing."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        from runner.engine.parallel.tensor import fused_colwise

        tp = tp_mesh.size()
        stream = Shard(1) if sequence_parallel else Replicate()
        local = not sequence_parallel
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        if sequence_parallel:  # split after the class token and positions are added; whole again for the head
            parallelize_module(self, tp_mesh, {
                "drop": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
                "norm": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True)})
        for block in self.blocks:
            if block is None or isinstance(block, nn.Identity):  # a pipeline rank's part: other ranks' blocks
                continue
            block.attn.heads = block.attn.heads // tp  # the heads this rank computes
            layer = {
                "attn.qkv": fused_colwise(3),
                "attn.proj": RowwiseParallel(output_layouts=stream, use_local_output=local),
                "mlp.0": ColwiseParallel(),
                "mlp.3": RowwiseParallel(output_layouts=stream, use_local_output=local),
            }
            if sequence_parallel:
                layer.update({"norm_1": SequenceParallel(), "norm_2": SequenceParallel(), "attn": gather, "mlp": gather})
            parallelize_module(block, tp_mesh, layer)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.patch_embed is None:  # a later pipeline stage (pipeline_stage): the input is the hidden state
            x = images
        else:
            x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
            x = self.drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        if self.head is None:  # an earlier pipeline stage: the hidden state goes on to the next
            return x
        return self.head(self.norm(x[:, 0]))

    def pipeline_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        """Stage `stage_index` of `num_stages` for pipeline parallelism: consecutive blocks (earlier stages
        take one more where they do not divide), the patch embedding, class token and positions in the
        first stage, the norm and head in the last. Parameter names stay the whole model's (blocks outside
        are nn.Identity, other parts None); the parameters are this model's own (shared, not copied)."""
        blocks = len(self.blocks)
        if not 0 < num_stages <= blocks:
            raise ValueError(f"num_stages: {num_stages} stages cannot be cut from {blocks} blocks; "
                             f"allowed: 1 to {blocks}")
        size, extra = divmod(blocks, num_stages)
        start = stage_index * size + min(stage_index, extra)
        stop = start + size + (stage_index < extra)
        stage = object.__new__(type(self))  # shares every part; its own parts can be replaced
        stage.__dict__ = {**self.__dict__, "_modules": dict(self._modules), "_parameters": dict(self._parameters),
                          "_buffers": dict(self._buffers)}
        stage.blocks = nn.ModuleList(b if start <= i < stop else nn.Identity() for i, b in enumerate(self.blocks))
        if stage_index > 0:
            stage.patch_embed = stage.cls_token = stage.pos_embed = None
        if stage_index < num_stages - 1:
            stage.norm = stage.head = None
        return stage
