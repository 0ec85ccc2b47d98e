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

from runner.addons.base import AddOn, EngineView

log = logging.getLogger(__name__)

# flat spec keys (RunSpec.flat) a population member may change at a round boundary
MUTABLE = ("optimizer.lr", "optimizer.lr_multipliers.*", "optimizer.weight_decay", "optimizer.momentum",
           "optimizer.betas", "model.dropout", "model.*dropout", "dataset.mixup_alpha", "dataset.cutmix_alpha",
           "task.label_smoothing", "task.*.label_smoothing", "trainer.clip_grad_norm")
_GROUP_KEYS = ("weight_decay", "momentum", "betas", "lr_multiplier")  # lr_multiplier: the group's logged name
_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # OneCycleLR keeps its peak and floor in the group


def is_mutable(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MUTABLE)


class MidRunChanges(AddOn):
    """PBT's mid-run changes, an engine add-on (runner/addons/base.py) that every member's run registers
    (runner/search/pbt/member.py). Its checkpoint entry is the mutable hyperparameters the run trained with;
    a resume whose spec gives others (explore's) puts this spec's values into the loaded optimizer and
    schedule. A checkpoint without the entry (written before it existed) gets them all put back, which
    changes nothing where nothing changed."""

    name = "pbt_changes"

    def setup(self, view: EngineView) -> None:
        self.view = view
        self.fresh = snapshot(view.optimizer)  # the hyperparameters this run's spec gives, before any checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"hyperparameters": mutable_values(self.view.spec)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        saved = None if state is None else state["hyperparameters"]
        apply_changed(saved, self.view.spec, self.view.optimizer, self.view.schedule, self.fresh)


def mutable_values(spec: Any) -> dict[str, Any]:
    return {k: v for k, v in spec.flat().items() if is_mutable(k)}


def snapshot(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's lr before any schedule moved it (initial_lr) and its other hyperparameters."""
    return [{"initial_lr": g.get("initial_lr", g["lr"]), **{k: g[k] for k in _GROUP_KEYS if k in g}}
            for g in optimizer.param_groups]


def apply_changed(saved: dict[str, Any] | None, spec: Any, optimizer: Any, schedule: Any, fresh: list[dict]) -> list[str]:
    """After a checkpoint was loaded: where this spec's mutable keys differ from the `saved` ones (the
    checkpoint's; None: unknown, every value put back), its values replace the loaded ones. Returns the
    changed keys (none for an ordinary resume, whose spec is the saved one)."""
    new = mutable_values(spec)
    changed = [] if saved is None else sorted(k for k in set(saved) | set(new) if saved.get(k) != new.get(k))
    if saved is not None and not changed:
        return []
    for i, (group, want) in enumerate(zip(optimizer.param_groups, fresh)):
        old = group.get("initial_lr", group["lr"])
        factor = want["initial_lr"] / old if old else None
        if factor is not None and factor != 1.0:
            for key in _LR_KEYS:
                if key in group:
                    group[key] = group[key] * factor
            schedule.scale_peak(i, factor)  # the schedule's own copy of the peak (base_lrs), SWA's included
        elif factor is None:  # a group frozen by a 0 multiplier before: its new lr from here, unscheduled
            group["lr"] = group["initial_lr"] = want["initial_lr"]
        for key in _GROUP_KEYS:
            if key in want:
                group[key] = want[key]
    if changed:
        log.info("resumed with changed hyperparameters: %s", ", ".join(f"{k}={new.get(k)!r}" for k in changed))
    return changed


