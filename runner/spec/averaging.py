"""The trainer's weight-averaging keys, trainer.ema and trainer.swa (runner/addons/averaging.py acts on them).

Kept apart from runner/spec/run.py so the spec module stays within its size; imports no torch: the spec is
checked before torch is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.spec.fields import SpecError, opt


@dataclass(frozen=True)
class EmaSpec:
    """An exponential moving average of the weights (runner/addons/averaging.py), evaluated as val/ema/*."""

    decay: Optional[float] = opt(None, "EMA_t = decay_t * EMA_(t-1) + (1 - decay_t) * weights_t after every optimizer "
                                       "step t, EMA_0 = the starting weights; e.g. 0.999; null: off", gt=0, lt=1)
    warmup: bool = opt(False, "decay_t = min(decay, (1 + t) / (10 + t)): early steps weigh more while the EMA would "
                              "still be mostly the random start")


@dataclass(frozen=True)
class SwaSpec:
    """Stochastic weight averaging (runner/addons/averaging.py): the mean of the weights at the ends of the last
    epochs, evaluated as val/swa/*; BatchNorm statistics recomputed for it at the end of training."""

    start_epoch: Optional[int] = opt(None, "average the weights at the end of this epoch (counted from 0) and of "
                                           "every later one; null: off", ge=0)
    lr: Optional[float] = opt(None, "from start_epoch on, anneal the lr to this value and hold it (torch SWALR); "
                                    "null: the run's own schedule goes on", gt=0)
    anneal_epochs: int = opt(1, "epochs the lr takes to reach swa.lr (cosine); 0: at once", ge=0)


def check_averaging(trainer) -> None:
    """RunSpec.validate's rules across the averaging keys and the run's length (trainer: a TrainerSpec)."""
    ema, swa = trainer.ema, trainer.swa
    if ema.warmup and ema.decay is None:
        raise SpecError("trainer.ema.warmup: true needs trainer.ema.decay (the EMA it warms up); set e.g. "
                        "trainer.ema.decay=0.999, or drop it")
    if swa.lr is not None and swa.start_epoch is None:
        raise SpecError(f"trainer.swa.lr: {swa.lr:g} needs trainer.swa.start_epoch (the epoch SWA starts); set it too, "
                        "or drop it")
    if swa.start_epoch is not None and trainer.max_steps is None and swa.start_epoch >= trainer.max_epochs:
        raise SpecError(f"trainer.swa.start_epoch: {swa.start_epoch} is never reached (trainer.max_epochs={trainer.max_epochs}"
                        f" ends with epoch {trainer.max_epochs - 1}); allowed: 0 to {trainer.max_epochs - 1}")
