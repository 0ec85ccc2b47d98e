"""The trial keys (conf/config.yaml's `trial`), set by the Optuna sweeper for each job (runner/search/trial.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.specs.fields import opt


@dataclass(frozen=True)
class TrialSpec:
    """Set by the Optuna sweeper (hparams_search): the job finds its trial in the study's storage."""

    storage: Optional[str] = opt(None, "Optuna storage of the study this run is a trial of")
    study_name: Optional[str] = opt(None, "name of that study")
    number: Optional[int] = opt(None, "this run's trial number in the study", ge=0)
