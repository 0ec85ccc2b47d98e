"""The trainer's k-fold keys, trainer.cross_validation (runner/search/cross_validation.py acts on them).

Kept apart from runner/spec/run.py so the spec module stays within its size; imports no torch: the spec is
checked before torch is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.spec.fields import SpecError, opt


@dataclass(frozen=True)
class CrossValidationSpec:
    """K-fold cross-validation: K runs, fold k validating on the k-th of K parts of train+val and training
    on the rest; the test split is the same for every fold. The run's objective is the folds' mean."""

    folds: Optional[int] = opt(None, "K: train K runs over the folds of train+val (stratified by class for "
                                     "classification) and return the mean objective; null: one ordinary run", ge=2)
    seed: int = opt(0, "the fold seed: which samples fall in which fold (the same seed gives the same folds, "
                       "whatever the run's seed)", ge=0, lt=2**32)
    fold: Optional[int] = opt(None, "train this fold only (0 to folds-1); runner sets it for each fold's run", ge=0)
    parent_run: Optional[str] = opt(None, "the MLflow run of the K-fold run a fold's run logs under (runner sets it)")


def check_cross_validation(spec) -> None:
    """RunSpec.validate's rules for the k-fold keys (spec: a RunSpec)."""
    from runner.spec.metric_names import fraction  # late: metric_names imports the spec module

    cv = spec.trainer.cross_validation
    if cv.folds is None:
        if cv.fold is not None:
            raise SpecError(f"trainer.cross_validation.fold: {cv.fold} needs trainer.cross_validation.folds (how many "
                            "folds there are); set e.g. trainer.cross_validation.folds=5, or drop it")
        return
    if cv.fold is not None and cv.fold >= cv.folds:
        raise SpecError(f"trainer.cross_validation.fold: {cv.fold} is out of range; allowed: 0 to {cv.folds - 1} "
                        f"(trainer.cross_validation.folds={cv.folds})")
    if "val_fraction" in spec.dataset.params and fraction(spec, "val") == 0:
        raise SpecError(f"trainer.cross_validation.folds: {cv.folds} folds train+val, but dataset.val_fraction=0 "
                        "leaves no validation split; set dataset.val_fraction > 0 (e.g. 0.15): train and val are "
                        "merged, then each fold validates on 1/K of them")
    if spec.mode != "train" and cv.fold is None:
        raise SpecError(f"trainer.cross_validation.folds: {cv.folds} trains K runs, so mode={spec.mode} has no one "
                        "model to use; name one fold's run directory (<run dir>/fold-<k>) in trainer.resume")
