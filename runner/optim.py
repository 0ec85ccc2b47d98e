"""Optimizers: one builder from `OptimizerSpec`; the update rules come from torch.optim and timm.optim.

Every optimizer sees the same parameter groups (`param_groups`): matrices decay, biases and
normalization weights do not, unless `decay_norm_and_bias` says otherwise. Hybrid optimizers (muon)
additionally split off the parameters that their fallback rule should update.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

import torch
from torch import nn

from runner.spec import OptimizerSpec, SpecError

# The kernel names are OptimizerSpec.impl's to list (checked when the spec is built); which of them
# each option offers, fastest first, is known only here; fused only where it runs (fused_kernel_runs).
class _Kernels(dict):
    """Kernels per optimizer; Lamb's are looked up on first use, because importing timm (and the
    torchvision it pulls in) costs seconds in every process that trains with a torch.optim rule."""

    def __missing__(self, name: str) -> tuple[str, ...]:
        if name != "lamb":
            raise KeyError(name)
        from timm.optim import Lamb

        # timm 1.0.29 has no foreach kernel for Lamb (1.0.31 has); pyproject allows both.
        self[name] = ("foreach", "for_loop") if "foreach" in inspect.signature(Lamb).parameters else ("for_loop",)
        return self[name]


KERNELS: dict[str, tuple[str, ...]] = _Kernels({
    "sgd": ("fused", "foreach", "for_loop"),
    "adam": ("fused", "foreach", "for_loop"),
    "adamw": ("fused", "foreach", "for_loop"),
    "adagrad": ("fused", "foreach", "for_loop"),
    "rmsprop": ("foreach", "for_loop"),
    "adafactor": ("foreach", "for_loop"),
    "muon": ("for_loop",),  # timm's Muon has one implementation and no switch
})


def build_optimizer(spec: OptimizerSpec, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by `spec.name` over the trainable parameters of `model` (already on `device`)."""
    fallback = muon_fallback_params(model) if spec.name == "muon" else set()
    try:
        groups = param_groups(model, spec.weight_decay, spec.decay_norm_and_bias, fallback, spec.lr, spec.lr_multipliers)
    except ValueError as e:
        raise SpecError(f"optimizer.lr_multipliers: {e}") from None
    if not groups:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    return _BUILDERS[spec.name](groups, spec, kernel_kwargs(spec.name, spec.impl, device))


def param_groups(model: nn.Module, weight_decay: float, decay_norm_and_bias: bool = False,
                 fallback: set[int] | frozenset[int] = frozenset(), lr: float = 0.0,
                 lr_multipliers: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Trainable parameters split into a decay and a no-decay group (each also split by `fallback`, ids).

    Decaying biases and norm gains only pulls them towards 0 (a norm gain of 0 silences its channel),
    so 1-D parameters, and whatever the model lists in `no_weight_decay()` (timm: pos_embed,
    cls_token), go to the weight_decay=0 group. Empty groups are dropped.
    """
    from runner.finetune import lr_multiplier_groups

    skip = set(getattr(model, "no_weight_decay", lambda: ())())
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    parts = lr_multiplier_groups(trainable, lr_multipliers) if lr_multipliers else [(1.0, trainable)]
    groups = []
    for multiplier, members in parts:
        buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
        for name, p in members:
            decay = decay_norm_and_bias or (p.ndim > 1 and name not in skip)
            buckets.setdefault((decay, id(p) in fallback), []).append(p)
        # The same group order for every model: decay before no-decay, then the fallback groups.
        for decay, use_fallback in ((True, False), (False, False), (True, True), (False, True)):
            if (decay, use_fallback) in buckets:
                group: dict[str, Any] = {"params": buckets[(decay, use_fallback)],
                                         "weight_decay": weight_decay if decay else 0.0}
                if use_fallback:
                    group["use_fallback"] = True
                if lr_multipliers:
                    group["lr"], group["lr_multiplier"] = lr * multiplier, multiplier
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


def kernel_kwargs(name: str, impl: str, device: torch.device) -> dict[str, bool]:
    """The `fused` / `foreach` arguments for optimizer `name` given `optimizer.impl` and the device."""
    offered = [k for k in KERNELS[name] if k != "fused" or fused_kernel_runs(name, device.type)]
    if impl == "auto":
        # Fused kernels are the fast path on CUDA; on CPU torch's fused code is not reliably faster,
        # while foreach at least batches the per-tensor work. KERNELS lists the fastest first.
        impl = next(k for k in offered if k != "fused" or device.type == "cuda")
    if impl not in offered:
        where = f" on {device.type} with torch {torch.__version__}" if impl in KERNELS[name] else ""
        raise SpecError(f"optimizer.impl: {impl!r} is not available for {name}{where}; "
                        f"choose one of auto, {', '.join(offered)}")
    if impl == "fused":
        return {"fused": True}
    if "foreach" not in offered:
        return {}
    kwargs = {"foreach": impl == "foreach"}
    if "fused" in KERNELS[name]:
        kwargs["fused"] = False  # explicit, so torch does not pick a kernel other than the one asked for
    return kwargs


@functools.cache
def fused_kernel_runs(name: str, device_type: str) -> bool:
    """Whether torch's fused kernel for optimizer `name` runs on `device_type`, found by taking one step:
    support differs by torch version (Adagrad's CUDA kernel is missing in torch 2.11, present in 2.14).
    """
    if name not in _FUSED_CLASSES:
        return False
    try:
        p = nn.Parameter(torch.zeros(2, device=device_type))
        p.grad = torch.zeros_like(p)
        _FUSED_CLASSES[name]([p], fused=True).step()
    except Exception:  # whatever the reason (no kernel, no such device), the kernel is not usable here
        return False
    return True


_FUSED_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad,
}


# --- one builder per option: (param groups, spec, kernel kwargs) -> optimizer ------------------------

Groups = Iterable[dict[str, Any]]


def _sgd(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    if spec.nesterov and spec.momentum == 0:
        raise SpecError("optimizer.nesterov: true needs optimizer.momentum > 0; set a momentum or nesterov: false")
    return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                           weight_decay=spec.weight_decay, **kernel)


def _adam(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    return torch.optim.Adam(groups, lr=spec.lr, betas=_betas(spec), eps=spec.eps,
                            weight_decay=spec.weight_decay, **kernel)


def _adamw(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=spec.lr, betas=_betas(spec), eps=spec.eps,
                             weight_decay=spec.weight_decay, **kernel)


def _rmsprop(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(groups, lr=spec.lr, alpha=spec.alpha, eps=spec.eps, momentum=spec.momentum,
                               weight_decay=spec.weight_decay, **kernel)


def _adagrad(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(groups, lr=spec.lr, eps=spec.eps, weight_decay=spec.weight_decay, **kernel)


def _adafactor(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    # spec.eps is torch's eps1, a floor on the rms scale (squared inside, so the paper's 1e-30 would
    # underflow to 0); eps2 keeps torch's 1e-3 floor on the relative step.
    return torch.optim.Adafactor(groups, lr=spec.lr, eps=(spec.eps, 1e-3), weight_decay=spec.weight_decay, **kernel)


def _lamb(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    # timm's Lamb clips the global gradient norm to 1.0 by default (NVIDIA's convention); clipping is
    # trainer.clip_grad_norm's job here, so a logged grad norm is the one the update saw.
    from timm.optim import Lamb

    return Lamb(groups, lr=spec.lr, betas=_betas(spec), eps=spec.eps, weight_decay=spec.weight_decay,
                max_grad_norm=None, **kernel)


def _muon(groups: Groups, spec: OptimizerSpec, kernel: dict[str, bool]) -> torch.optim.Optimizer:
    # timm's default lr scaling (match_rms_adamw) makes Muon's update RMS match AdamW's, so one lr
    # serves both the Muon matrices and the AdamW fallback; betas and eps feed the fallback.
    from timm.optim import Muon

    return Muon(groups, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov, betas=_betas(spec),
                eps=spec.eps, weight_decay=spec.weight_decay, **kernel)


def _betas(spec: OptimizerSpec) -> tuple[float, float]:
    return spec.betas  # two numbers in [0, 1): the spec's type and bounds say so


_BUILDERS: dict[str, Callable[[Groups, OptimizerSpec, dict[str, bool]], torch.optim.Optimizer]] = {
    "sgd": _sgd, "adam": _adam, "adamw": _adamw, "rmsprop": _rmsprop, "adagrad": _adagrad,
    "adafactor": _adafactor, "lamb": _lamb, "muon": _muon,
}
