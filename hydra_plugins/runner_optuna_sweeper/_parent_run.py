"""The MLflow parent run of a multirun: the Optuna sweeper's study, or a plain grid multirun.

Jobs find the parent through the RUNNER_PARENT_RUN_ID environment variable (runner.trial), set here
in the sweep process before any job starts; in-process jobs and spawned slot processes read it.
A grid multirun gets its parent from `ParentRunCallback` (conf/config.yaml: hydra.callbacks); the
Optuna sweeper opens its own, reused by every sweep process of the same study and on resume.
"""
from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runner.tracking import experiment_id, run_exists
from runner.trial import PARENT_RUN_ENV

log = logging.getLogger(__name__)


class ParentRun:
    def __init__(self, uri: str, experiment: str, artifact_root: str):
        for name in ("alembic", "mlflow.store.db.utils", "mlflow.tracking"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.uri, self.experiment, self.artifact_root = uri, experiment, artifact_root
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id: str | None = None

    @classmethod
    def from_config(cls, config: DictConfig) -> ParentRun | None:
        """From the composed task config's `tracking` node; None for apps without MLflow tracking."""
        tracking = OmegaConf.select(config, "tracking", default=None)
        if not isinstance(tracking, DictConfig) or OmegaConf.select(tracking, "name", default=None) != "mlflow":
            return None
        t = OmegaConf.to_container(tracking, resolve=True)
        return cls(t["uri"], t.get("experiment", "runner"), t.get("artifact_root", "outputs/mlartifacts"))

    def start(self, name: str, tags: dict[str, str], params: dict[str, Any], reuse: str | None = None) -> str:
        """Open the parent (or reopen `reuse` when it still exists) and publish it to jobs."""
        if reuse and run_exists(self.client, reuse):
            self.run_id = reuse
            self.client.update_run(reuse, status="RUNNING")
        else:
            experiment = experiment_id(self.client, self.experiment, self.uri, self.artifact_root)
            run = self.client.create_run(experiment, run_name=name, tags=tags)
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i:i + 100])
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        os.environ[PARENT_RUN_ENV] = self.run_id
        return self.run_id

    def log_artifact(self, path: Path) -> None:
        if path.exists():
            self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        if os.environ.get(PARENT_RUN_ENV) == self.run_id:
            del os.environ[PARENT_RUN_ENV]
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
            self.run_id = None


class ParentRunCallback(Callback):
    """A grid multirun (`python -m runner -m optimizer=sgd,adamw`) as one MLflow parent run with a
    child per job. The Optuna sweeper opens its own parent, so it is skipped here."""

    def __init__(self) -> None:
        self.parent: ParentRun | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "runner_optuna_sweeper" in str(OmegaConf.select(config, "hydra.sweeper._target_", default="")):
            return
        self.parent = ParentRun.from_config(config)
        if self.parent is None:
            return
        overrides = list(OmegaConf.select(config, "hydra.overrides.task", default=[]) or [])
        self.parent.start(name="multirun " + " ".join(overrides)[:200],
                          tags={"runner.sweeper": "basic", "overrides": " ".join(overrides) or "(none)",
                                "sweep_dir": str(config.hydra.sweep.dir)},
                          params={})
        atexit.register(self._finish_if_open, "FAILED")  # a job that raises ends the sweep before on_multirun_end

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish_if_open("FINISHED")

    def _finish_if_open(self, status: str) -> None:
        if self.parent is not None and self.parent.run_id is not None:
            self.parent.finish(status)
