"""The tracking group (conf/tracking/<name>.yaml; runner/tracking/ acts on it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from runner.specs.fields import opt


@dataclass(frozen=True)
class TrackingSpec:
    name: str = opt("mlflow", "tracking option (conf/tracking/<name>.yaml): mlflow, or none for no tracking at all")
    uri: str = opt("sqlite:///outputs/mlflow.db", "MLflow tracking URI")
    experiment: str = opt("runner", "MLflow experiment name")
    artifact_root: str = opt("outputs/mlartifacts", "artifact location for new experiments on a local store")
    run_name: Optional[str] = opt(None, "MLflow run name; default: built from the overrides")
    log_model: Literal["best", "last", "none"] = opt(
        "none", "log the model as an MLflow model (mlflow.pytorch) at the end: best (the weights the test used), "
                "last, or none (runner/addons/mlflow_model.py)")
