"""Optimizers: any optimizer class named by `optimizer._target_` (torch.optim's, timm's or a user's), built
over the parameter groups runner decides.

Every optimizer sees the same parameter groups (`param_groups`): matrices decay, biases and
normalization weights do not, unless `decay_norm_and_bias` says otherwise; `lr_multipliers` scale the
lr of the parameters their globs match. Hybrid optimizers (timm's Muon) additionally split off the
parameters that their fallback rule should update. The kernel (`optimizer.impl`) is chosen among those
the class's signature offers (`fused`, `foreach`, else its plain loop).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from runner.engine.components import build_component
from runner.specs.components import load_target
from runner.specs.optimizer import OptimizerSpec
from runner.specs.run import SpecError


def build_optimizer(spec: OptimizerSpec, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `spec.target` over the trainable parameters of `model` (already on `device`)."""
    cls = load_target("optimizer", spec.target)
    fallback = muon_fallback_params(model) if routes_to_fallback(cls) else set()
    try:
        groups = param_groups(model, spec.get("weight_decay"), spec.decay_norm_and_bias, fallback,
                              lr_multipliers=spec.lr_multipliers)
    except ValueError as e:
        raise SpecError(f"optimizer.lr_multipliers: {e}") from None
    if not groups:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    optimizer = build_component("optimizer", spec.target, spec.params, kernel_kwargs(cls, spec.impl, device), groups)
    for group in optimizer.param_groups:  # the optimizer's own lr, whatever key the class gives it, scaled
        if "lr_multiplier" in group:
            group["lr"] = group["lr"] * group["lr_multiplier"]
    return optimizer


def routes_to_fallback(cls: type) -> bool:
    """Whether the optimizer reads the `use_fallback` key of a parameter group: timm's Muon family
    orthogonalizes matrices and leaves the groups marked so to its AdamW rule."""
    return cls.__module__.startswith("timm.") and "Muon" in cls.__name__


def param_groups(model: nn.Module, weight_decay: float | None, decay_norm_and_bias: bool = False,
                 fallback: set[int] | frozenset[int] = frozenset(),
                 lr_multipliers: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Trainable parameters split into a decay and a no-decay group (each also split by `fallback`, ids);
    no split by decay for an optimizer without weight decay (`weight_decay` None).

    Decaying biases and norm gains only pulls them towards 0 (a norm gain of 0 silences its channel),
    so 1-D parameters, and whatever the model lists in `no_weight_decay()` (timm: pos_embed,
    cls_token), go to the weight_decay=0 group. Empty groups are dropped.
    """
    from runner.engine.finetune import lr_multiplier_groups

    skip = set(getattr(model, "no_weight_decay", lambda: ())())
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    parts = lr_multiplier_groups(trainable, lr_multipliers) if lr_multipliers else [(1.0, trainable)]
    groups = []
    for multiplier, members in parts:
        buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for name, p in members:
            decay = weight_decay is None or decay_norm_and_bias or (p.ndim > 1 and name not in skip)
            buckets.setdefault((decay, id(p) in fallback), []).append(p)
        # The same group order for every model: decay before no-decay, then the fallback groups.
        for decay, use_fallback in ((True, False), (False, False), (True, True), (False, True)):
            if (decay, use_fallback) in buckets:
                group: dict[str, Any] = {"params": buckets[(decay, use_fallback)]}
                if not decay:  # the decaying group keeps the optimizer's own weight_decay
                    group["weight_decay"] = 0.0
                if use_fallback:
                    group["use_fallback"] = True
                if lr_multipliers:
                    group["lr_multiplier"] = multiplier
                groups.append(group)
    return groups


def muon_fallback_params(model: nn.Module) -> set[int]:
    """Ids of the parameters Muon should leave to its AdamW fallback beyond those timm routes by shape.

    timm routes by shape only: 1-D tensors, leading unit dims (pos_embed) and extreme aspect ratios
    fall back, but an embedding table or the classifier head is a well-shaped matrix and would get
    Muon. Muon's authors keep both on AdamW (orthogonalizing a lookup table or the logits layer does
    not help), so they are named here: embedding modules, the head (`get_classifier()` when the
    model has it, as timm models do, else the last nn.Linear registered) and `no_weight_decay()`.
    """
    ids = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
           for p in m.parameters()}
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if not isinstance(head, nn.Module):
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        head = linears[-1] if linears else None
    if head is not None:
        ids |= {id(p) for p in head.parameters()}
    named = dict(model.named_parameters())
    ids |= {id(named[n]) for n in getattr(model, "no_weight_decay", lambda: ())() if n in named}
    return ids


def kernels(cls: type) -> tuple[str, ...]:
    """The kernels an optimizer class offers, fastest first: the switches its signature has, and its loop."""
    try:
        names = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        names = {}
    return (*(k for k in ("fused", "foreach") if k in names), "for_loop")


def kernel_kwargs(cls: type, impl: str, device: torch.device) -> dict[str, bool]:
    """The `fused` / `foreach` arguments for optimizer class `cls` given `optimizer.impl` and the device."""
    offered = [k for k in kernels(cls) if k != "fused" or fused_kernel_runs(cls, device.type)]
    if impl == "auto":
        # Fused kernels are the fast path on CUDA; on CPU torch's fused code is not reliably faster,
        # while foreach at least batches the per-tensor work. kernels() lists the fastest first.
        impl = next(k for k in offered if k != "fused" or device.type == "cuda")
    if impl not in offered:
        where = f" on {device.type} with torch {torch.__version__}" if impl in kernels(cls) else ""
        raise SpecError(f"optimizer.impl: {impl!r} is not available for {cls.__name__}{where}; "
                        f"choose one of auto, {', '.join(offered)}")
    if impl == "fused":
        return {"fused": True}
    if "foreach" not in offered:
        return {}
    kwargs = {"foreach": impl == "foreach"}
    if "fused" in kernels(cls):
        kwargs["fused"] = False  # explicit, so torch does not pick a kernel other than the one asked for
    return kwargs


@functools.cache
def fused_kernel_runs(cls: type, device_type: str) -> bool:
    """Whether the fused kernel of optimizer class `cls` runs on `device_type`, found by taking one step:
    support differs by torch version (Adagrad's CUDA kernel is missing in torch 2.11, present in 2.14).
    """
    if "fused" not in kernels(cls):
        return False
    try:
        p = nn.Parameter(torch.zeros(2, device=device_type))
        p.grad = torch.zeros_like(p)
        cls([p], fused=True).step()
    except Exception:  # whatever the reason (no kernel, no such device), the kernel is not usable here
        return False
    return True
