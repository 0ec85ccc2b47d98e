"""The tune group (conf/tune/<name>.yaml): a finder that runs before training (runner/tune/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from runner.specs.fields import SpecError, opt


@dataclass(frozen=True)
class TuneSpec:
    """A finder that runs before training (conf/tune/<name>.yaml, runner/tune/): `tune=lr_find` sweeps the
    learning rate, `tune=batch_size` the micro-batch. It prints what it found and the override to use;
    with `apply` the run then trains with it. The keys of the finder not chosen keep their defaults."""

    name: Optional[Literal["lr_find", "batch_size"]] = opt(None, "the finder to run before training; null: none")
    apply: bool = opt(False, "train with what the finder found (false: find, report and stop)")
    # lr_find
    min_lr: float = opt(1e-7, "lr_find: the sweep's first learning rate", gt=0)
    max_lr: float = opt(10.0, "lr_find: the sweep's last learning rate (if the loss has not diverged before)", gt=0)
    steps: int = opt(200, "lr_find: optimizer steps of the sweep (the data repeats when an epoch is shorter)",
                     ge=10, le=100_000)
    smoothing: float = opt(0.9, "lr_find: the loss's exponential moving average factor (0: no smoothing)", ge=0, lt=1)
    diverge_factor: float = opt(4.0, "lr_find: the sweep stops once the smoothed loss exceeds this x its best", gt=1)
    # batch_size
    max_batch_size: int = opt(4096, "batch_size: the largest micro-batch tried (and never more than a rank's "
                                    "share of the training split)", ge=2, le=2**20)
    steps_per_candidate: int = opt(3, "batch_size: timed optimizer steps per candidate, after one untimed", gt=0, le=1000)
    knee_tolerance: float = opt(0.05, "batch_size: the knee is the smallest batch within this fraction of the "
                                      "best throughput", ge=0, lt=1)
    pick: Literal["knee", "largest"] = opt("knee", "batch_size: the answer: the throughput knee, or the largest "
                                                   "micro-batch that fits")
    keep_global_batch: bool = opt(False, "batch_size: change accumulation.steps so batch x accumulation x ranks "
                                         "stays as it is (the optimisation is unchanged)")

    def __to_plain__(self) -> dict:
        """Only the chosen finder's keys (spec.yaml, MLflow params)."""
        own = {"name": self.name} if self.name is None else {"name": self.name, "apply": self.apply}
        keys = _TUNE_KEYS.get(self.name or "", ())
        return {**own, **{k: getattr(self, k) for k in keys}}


_TUNE_KEYS = {"lr_find": ("min_lr", "max_lr", "steps", "smoothing", "diverge_factor"),
              "batch_size": ("max_batch_size", "steps_per_candidate", "knee_tolerance", "pick", "keep_global_batch")}




def check_tune(tune: TuneSpec) -> None:
    """RunSpec.validate's rule across the finder's keys."""
    if tune.name == "lr_find" and tune.min_lr >= tune.max_lr:
        raise SpecError(f"tune.min_lr: {tune.min_lr:g} is not below tune.max_lr ({tune.max_lr:g}); "
                        "the sweep rises from min_lr to max_lr, e.g. tune.min_lr=1e-7 tune.max_lr=10")
