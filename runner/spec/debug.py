"""The trainer's debugging keys (conf/debug/<preset>.yaml sets them; runner/engine/debugging.py acts on them).

A base of runner/spec/run.py's TrainerSpec, kept apart so the spec module stays one screenful per concern.
Imports no torch: the spec is checked before torch is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.spec.fields import opt


@dataclass(frozen=True)
class DebugKeys:
    limit_train: float = opt(1.0, "train on this fraction of the training split: its first samples, taken before "
                                  "they are dealt to ranks (every rank and a resumed run see the same ones)", gt=0, le=1)
    limit_val: float = opt(1.0, "validate on this fraction of the validation split (its first samples)", gt=0, le=1)
    limit_test: float = opt(1.0, "test on this fraction of the test split (its first samples)", gt=0, le=1)
    max_eval_batches: Optional[int] = opt(None, "validate and test on at most this many global batches (the first "
                                                "samples of each split); null: the whole (limited) split", gt=0)
    overfit_batches: int = opt(0, "train on the first N global batches of the training split only, repeated until the "
                                  "training loss is below overfit_target_loss (0: off)", ge=0)
    overfit_target_loss: float = opt(0.01, "overfit_batches: stop once every batch's training loss of one pass over "
                                           "them is below this", gt=0)
    save_checkpoints: bool = opt(True, "write checkpoints (false: none, not even the final one)")
    detect_anomaly: bool = opt(False, "torch.autograd anomaly detection for the run: the first backward producing "
                                      "NaN stops the run naming the step (slow)")
    check_finite_every_step: bool = opt(False, "check that the loss is finite after every optimizer step (a device "
                                               "sync per step) instead of on log steps")
