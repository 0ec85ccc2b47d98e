"""The hyperparameters that may change in the middle of a run, and how a resumed run takes them up.

Everything else a checkpoint holds was built for the spec it was saved with (the model's shape, the
optimizer's state, the data order); these keys change only how the next steps are taken. A changed
lr scales the schedule's base lr, so the schedule's shape (warmup, decay) continues from where it is.
Dropout, mixup/cutmix, label smoothing and clipping are read from the spec when the engine is built,
so a resumed engine takes them up by itself; the optimizer's are overwritten by the checkpoint's
param groups and are put back here.
"""
from __future__ import annotations

import fnmatch
import logging
from typing import Any

import yaml

from runner.spec.fields import flat_keys

log = logging.getLogger(__name__)

# flat spec keys (RunSpec.flat) a population member may change at a round boundary
MUTABLE = ("optimizer.lr", "optimizer.lr_multipliers.*", "optimizer.weight_decay", "optimizer.momentum",
           "optimizer.betas", "model.dropout", "model.*dropout", "dataset.mixup_alpha", "dataset.cutmix_alpha",
           "task.label_smoothing", "task.*.label_smoothing", "trainer.clip_grad_norm")
_GROUP_KEYS = ("weight_decay", "momentum", "betas", "lr_multiplier")  # lr_multiplier: the group's logged name
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # OneCycleLR keeps its peak and floor in the group


def is_mutable(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MUTABLE)


def snapshot(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's lr before any schedule moved it (initial_lr) and its other hyperparameters."""
    return [{"initial_lr": g.get("initial_lr", g["lr"]), **{k: g[k] for k in _GROUP_KEYS if k in g}}
            for g in optimizer.param_groups]


def apply_changed(saved_yaml: str | None, spec: Any, optimizer: Any, schedule: Any, fresh: list[dict]) -> list[str]:
    """After a checkpoint was loaded: where this spec's mutable keys differ from the saved spec's, its values
    replace the loaded ones. Returns the changed keys (none for an ordinary resume, whose spec is the saved one)."""
    if not saved_yaml:
        return []
    saved = flat_keys(yaml.safe_load(saved_yaml))
    new = spec.flat()
    changed = sorted(k for k in set(saved) | set(new) if is_mutable(k) and saved.get(k) != new.get(k))
    if not changed:
        return []
    scheduler = getattr(schedule, "scheduler", schedule)
    inner = [scheduler, *getattr(scheduler, "_schedulers", [])]  # SequentialLR (warmup) holds its parts
    for i, (group, want) in enumerate(zip(optimizer.param_groups, fresh)):
        old = group.get("initial_lr", group["lr"])
        factor = want["initial_lr"] / old if old else None
        if factor is not None and factor != 1.0:
            for key in _LR_KEYS:
                if key in group:
                    group[key] = group[key] * factor
            for part in inner:
                if hasattr(part, "base_lrs") and i < len(part.base_lrs):
                    part.base_lrs[i] = part.base_lrs[i] * factor
        elif factor is None:  # a group frozen by a 0 multiplier before: its new lr from here, unscheduled
            group["lr"] = group["initial_lr"] = want["initial_lr"]
        for key in _GROUP_KEYS:
            if key in want:
                group[key] = want[key]
    log.info("resumed with changed hyperparameters: %s", ", ".join(f"{k}={new.get(k)!r}" for k in changed))
    return changed


