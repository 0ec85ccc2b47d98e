"""A decoder-only transformer language model in the GPT-2 layout.

Pre-norm blocks, causal self-attention through `scaled_dot_product_attention` (so PyTorch picks the
flash / memory-efficient kernel the device has), a GELU MLP, and an lm head tied to the token
embedding. `size="gpt2"` with vocab 50257 and max_length 1024 is GPT-2 small (124,439,808 parameters).
"""
from __future__ import annotations

import math
from typing import Literal, Optional

import torch
from torch import nn
from torch.nn import functional as F

# (n_layer, n_head, n_embd) per named size; explicit n_* arguments override single fields
SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 2, 128),
    "mini": (4, 4, 256),
    "small": (6, 6, 384),
    "gpt2": (12, 12, 768),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        # one projection for q, k and v: a single matmul instead of three
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # thirds, not slices of the input's width: under tensor parallelism qkv gives this rank's [q | k | v] of
        # its own n_head heads (parallelize_tensor)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads), the layout SDPA expects
        q, k, v = (t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, length, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size).

    `vocab_size` and `max_length` come from the data; `size` picks the shape, and n_layer / n_head /
    n_embd, when given, override the size's value for that one field.
    """

    def __init__(
        self,
        vocab_size: int,
        max_length: int = 256,
        size: Literal["tiny", "mini", "small", "gpt2"] = "tiny",
        n_layer: Optional[int] = None,
        n_head: Optional[int] = None,
        n_embd: Optional[int] = None,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if size not in SIZES:
            raise ValueError(f"size: {size!r} is not a known size; allowed: {', '.join(SIZES)}")
        default_layer, default_head, default_embd = SIZES[size]
        n_layer = default_layer if n_layer is None else n_layer
        n_head = default_head if n_head is None else n_head
        n_embd = default_embd if n_embd is None else n_embd
        for name, value in (("vocab_size", vocab_size), ("max_length", max_length), ("n_layer", n_layer),
                            ("n_head", n_head), ("n_embd", n_embd)):
            if value < 1:
                raise ValueError(f"{name}: {value} is too small; allowed: an integer >= 1")
        if n_embd % n_head:
            raise ValueError(f"n_embd: {n_embd} is not divisible by n_head={n_head}; "
                             f"allowed: a multiple of {n_head}, e.g. {n_head * max(1, round(n_embd / n_head))}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: {dropout} is out of range; allowed: 0 <= dropout < 1")
        self.vocab_size, self.max_length = vocab_size, max_length
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd

        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(max_length, n_embd)
        self.drop = nn.Dropout(dropout)
        # a ModuleList: the engine's FSDP wrapping shards each child of it as its own unit
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = TiedLinear(n_embd, vocab_size, bias=False)
        # tying saves vocab*n_embd parameters (38.6M of GPT-2's 124M) and is how GPT-2 was trained
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # each block adds two residual branches; scaling their output projections keeps the residual
        # stream's variance from growing with depth (GPT-2 paper, section 2.3)
        residual_std = 0.02 / math.sqrt(2 * n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def parallelize_tensor(self, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
        """Tensor parallelism across tp_mesh (runner/engine/parallel/tensor.py), in place: each rank computes
        n_head / tp heads (qkv by columns, its projection back by rows) and a 1 / tp slice of the MLP (fc by
        columns, proj by rows); the vocabulary is split in the embedding and the lm head, which stay tied.
        sequence_parallel: the norms, dropouts and the residual stream hold 1 / tp of the sequence (gathered
        before attention and the MLP). loss_parallel: the logits stay split by vocabulary (a DTensor) into
        the loss; otherwise every rank gets them whole."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        from runner.engine.parallel.tensor import fused_colwise

        tp = tp_mesh.size()
        stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the blocks
        # the residual stream stays a DTensor under sequence parallelism: its global length is kept even when
        # the sequence does not divide by tp
        local = not sequence_parallel
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel),
        }
        if sequence_parallel:  # the position embedding is added whole; the stream is split from the dropout on
            plan["drop"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
            plan["ln_f"] = SequenceParallel()
        # a pipeline rank's part of the model (pipeline_stage) lacks the parts other ranks hold: None, or blocks
        # that are absent or nn.Identity
        parallelize_module(self, tp_mesh, {k: v for k, v in plan.items() if getattr(self, k) is not None})
        if self.wte is not None and self.lm_head is not None:
            self.lm_head.weight = self.wte.weight  # both split the vocabulary alike: tied again, one parameter
        for block in self.blocks:
            if not isinstance(block, Block):
                continue
            block.attn.n_head = self.n_head // tp  # the heads this rank computes
            layer = {
                "attn.qkv": fused_colwise(3),
                "attn.proj": RowwiseParallel(output_layouts=stream, use_local_output=local),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(output_layouts=stream, use_local_output=local),
            }
            if sequence_parallel:
                layer.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": gather, "mlp": gather})
            parallelize_module(block, tp_mesh, layer)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # torch's defaults scale with fan-in; GPT-2 uses a flat 0.02, which trains better at these widths
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (B, T, vocab_size); position t sees tokens 0..t only.

        attention_mask is accepted so padded text batches can be passed as they come, but not applied:
        with padding on the right, causal attention already keeps every real token from seeing the pads
        after it, and the pads' own outputs are dropped by their -100 labels. positions (T,): the
        sequence positions of the tokens given; context parallelism passes each rank's (sharded) share.
        """
        # the tied weight's gradient made in one whole tensor (TiedGradient): where the weight is both the embedding
        # and the head in this forward pass, as a plain parameter trained eagerly
        link = TiedGradient() if self.wte is not None and self.lm_head is not None and \
            self.lm_head.weight is self.wte.weight and TiedGradient.applies(self.wte.weight) else None
        self.tied_gradient_whole = link is not None
        if self.wte is None:  # a later pipeline stage (pipeline_stage): the input is the hidden state
            x = input_ids
        else:
            x = self._embed(input_ids, positions, link)
        for block in self.blocks:
            x = block(x)
        if self.lm_head is None:  # an earlier pipeline stage: the hidden state goes on to the next
            return x
        # a later pipeline stage holds the head without the embedding: its weight is used once there
        return self.lm_head(self.ln_f(x), embedded=self.wte is not None, tied_gradient=link)

    def _embed(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
               link: Optional["TiedGradient"] = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)} is not (batch, length)")
        length = input_ids.shape[1]
        if length > self.max_length:
            raise ValueError(f"input_ids: sequence length {length} exceeds max_length={self.max_length}; "
                             f"allowed: at most {self.max_length} tokens (raise model max_length)")
        if positions is None:
            positions = torch.arange(length, device=input_ids.device)
        tokens = self.wte(input_ids) if link is None else _EmbeddingGradient.apply(input_ids, self.wte.weight, link)
        return self.drop(tokens + self.wpe(positions))

    # whether the last forward pass's backward makes the tied weight's gradient whole in one accumulation (TiedGradient)
    tied_gradient_whole = False

    def fsdp_gradient_made_whole(self) -> Optional[nn.Parameter]:
        """Sharded data parallelism (runner/engine/parallel/wrap.py): the parameter whose gradient this model's backward
        makes whole, in one accumulation, where `tied_gradient_whole` says the last forward pass did (the tied weight,
        as registered now); None where there is none (a pipeline stage holding one end)."""
        if self.wte is None or self.lm_head is None or self.lm_head.weight is not self.wte.weight:
            return None
        return self.wte.weight

    def fsdp_units(self) -> list[nn.Module]:
        """Sharded data parallelism (runner/engine/parallel/wrap.py): the modules besides the blocks that are units of
        their own (the position embedding, the final norm), so that the root unit holds the tied weight alone and
        can gather it straight into the weight's own memory. Empty where the weight is not tied here (a pipeline
        stage holding one end)."""
        return [self.wpe, self.ln_f] if self.fsdp_gradient_made_whole() is not None else []

    def fsdp_root_read_until(self) -> Optional[nn.Module]:
        """Sharded data parallelism (runner/engine/parallel/wrap.py): the module whose backward is the last to read a
        weight of the root's unit (the tied embedding and head, the position embedding, the final norm): the final
        norm, whose backward follows the head's; the embeddings' backward reads no weight (only the token ids and
        the gradient). The unit then frees its gathered weights there rather than at the backward's end, where the
        whole tied weight (GPT-2: 50257 x 768, 147 MiB) sat beside its whole gradient. None in a pipeline stage
        without the head."""
        return self.ln_f if self.lm_head is not None else None

    def pipeline_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        """Stage `stage_index` of `num_stages` for pipeline parallelism: consecutive blocks (earlier stages
        take one more where they do not divide), the embeddings in the first stage, the final norm and
        the lm head in the last. Parameter names stay the whole model's (blocks outside are nn.Identity,
        other parts None), and the parameters are this model's own (shared, not copied). The tied lm head
        is the embedding's weight: a pipeline keeps the two stages' copies equal."""
        start, stop = stage_blocks(len(self.blocks), stage_index, num_stages)
        stage = _shallow_copy(self)
        stage.blocks = nn.ModuleList(b if start <= i < stop else nn.Identity() for i, b in enumerate(self.blocks))
        if stage_index > 0:
            stage.wte = stage.wpe = None
        if stage_index < num_stages - 1:
            stage.ln_f = stage.lm_head = None
        return stage


class TiedLinear(nn.Linear):
    """The lm head, whose weight is also the token embedding's.
    embedded: whether this forward pass used the weight as the embedding too (not in a pipeline's last stage).
    tied_gradient: where given, the weight's gradient is made with the embedding's (TiedGradient); otherwise, where
    the weight is the embedding's too (a tensor-parallel DTensor), the head's share is copied out of its view into a
    tensor of its own (_OwnGradient), to which autograd adds the embedding's in place rather than into a third."""

    def forward(self, x: torch.Tensor, embedded: bool = True,
                tied_gradient: Optional["TiedGradient"] = None) -> torch.Tensor:
        if not embedded:
            return super().forward(x)
        if tied_gradient is not None and self.bias is None:
            return _HeadGradient.apply(x, self.weight, tied_gradient)
        return F.linear(x, _OwnGradient.apply(self.weight), self.bias)


class TiedGradient:
    """The tied weight's gradient in one whole tensor. Autograd sums a weight's gradients from its uses before the
    weight's accumulation, in place only in some cases: nn.Linear's weight gradient is a view (the transpose of a
    product laid out the other way) and the embedding's is a whole tensor of zeros around the batch's rows, so the
    sum of the two is a third (for GPT-2 three 50257 x 768 tensors, 147 MiB each, at the backward pass's peak).
    Here the head's backward makes its share in the weight's own layout (grad^T @ x: the same products) and hands
    it on to the embedding's backward, which adds the rows the batch used into it in place (summed as torch's
    dense backward sums them, in token order from zero): one whole tensor, and the same gradient bit for bit
    (tests/models/test_gpt.py). Where the step's tokens are fewer than the weight's width, the head's share is kept
    until then as its two factors (the logits' gradient, tokens x vocabulary, and the head's input), which hold less
    than the share: under fsdp the blocks' backward then runs without a whole 50257 x 768 tensor beside the gathered
    weight. One per forward pass, from the embedding to the head."""

    __slots__ = ("head", "factors")

    def __init__(self) -> None:
        self.head: Optional[torch.Tensor] = None  # the head's share, from its backward until the embedding's
        self.factors: Optional[tuple[torch.Tensor, torch.Tensor, torch.dtype]] = None  # or what it is made of

    def keep(self, grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, whole: int) -> None:
        """The head's share grad^T @ x (grad: tokens x vocabulary, x: tokens x width), made now, or kept as its
        factors where they hold fewer elements than the share (`whole`)."""
        if self.head is None and self.factors is None and grad.numel() + x.numel() <= whole:
            self.factors = (grad, x, dtype)
        else:
            self._add(grad.t().mm(x).to(dtype))

    def take(self) -> Optional[torch.Tensor]:
        """The head's share, made now where it was kept as factors (the same product); None where the head's
        backward did not run."""
        if self.factors is not None:
            (grad, x, dtype), self.factors = self.factors, None
            self._add(grad.t().mm(x).to(dtype))
        head, self.head = self.head, None
        return head

    def _add(self, share: torch.Tensor) -> None:
        self.head = share if self.head is None else self.head.add_(share)

    @staticmethod
    def applies(weight: torch.Tensor) -> bool:
        """Whether the functions below compute the weight's gradient: a plain parameter (one process, ddp, fsdp's
        gathered weight; not a tensor-parallel DTensor) trained eagerly (not traced by torch.compile)."""
        return (type(weight) is nn.Parameter and weight.requires_grad and torch.is_grad_enabled()
                and not torch.compiler.is_compiling())


class _HeadGradient(torch.autograd.Function):
    """F.linear(x, weight) without a bias, whose backward leaves the weight's gradient to the embedding's backward
    (TiedGradient). Under autocast the products run in the forward's compute dtype and the gradients take their
    inputs' dtypes, as autocast's casts give them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, link: TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.link = link
        return F.linear(x, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, weight = ctx.saved_tensors
        dtype = grad.dtype
        grad_x = grad.matmul(weight.to(dtype)).to(x.dtype)
        ctx.link.keep(grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(dtype), weight.dtype, weight.numel())
        return grad_x, None, None


class _EmbeddingGradient(torch.autograd.Function):
    """The token embedding, whose backward gives the tied weight's whole gradient: the head's share (TiedGradient)
    with the batch's rows added in place (zeros where the head's backward did not run)."""

    @staticmethod
    def forward(ctx, input_ids: torch.Tensor, weight: torch.Tensor, link: TiedGradient) -> torch.Tensor:
        ctx.save_for_backward(input_ids)
        ctx.link, ctx.weight_shape, ctx.weight_dtype = link, weight.shape, weight.dtype
        return F.embedding(input_ids, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (input_ids,) = ctx.saved_tensors
        width = grad.shape[-1]
        rows, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        sums = grad.new_zeros(len(rows), width).index_add_(0, inverse, grad.reshape(-1, width))
        whole = ctx.link.take()
        if whole is None:
            whole = grad.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)
        return None, whole.index_add_(0, rows, sums.to(whole.dtype)), None


class _OwnGradient(torch.autograd.Function):
    """The identity whose backward hands on a copy of the gradient (a tensor of its own, not a view)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone(memory_format=torch.contiguous_format)


def stage_blocks(blocks: int, stage_index: int, num_stages: int) -> tuple[int, int]:
    """The blocks [start, stop) of one pipeline stage: as even as they divide, earlier stages one more."""
    if not 0 < num_stages <= blocks:
        raise ValueError(f"num_stages: {num_stages} stages cannot be cut from {blocks} blocks; allowed: 1 to {blocks}")
    size, extra = divmod(blocks, num_stages)
    start = stage_index * size + min(stage_index, extra)
    return start, start + size + (stage_index < extra)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object of the same class sharing every submodule and parameter, whose own
    submodules can be replaced without touching `module`."""
    copy = object.__new__(type(module))
    copy.__dict__ = {**module.__dict__, "_modules": dict(module._modules),
                     "_parameters": dict(module._parameters), "_buffers": dict(module._buffers)}
    return copy
