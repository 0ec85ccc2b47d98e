"""What a run's tracker asks of its MLflow store, as calls that take and return plain data (strings,
numbers, dicts and lists): the same calls answer in the training process (`Store`, on an MlflowClient)
or from the tracking process (runner/tracking/store_process.py), where MLflow is imported and the
store opened on another core while the training process imports torch and builds the run; nothing the
training process holds then needs MLflow's classes.
"""
from __future__ import annotations

from typing import Any

from runner.tracking.mlflow_store import check_tracking, make_call, open_client, open_experiment
from runner.specs.tracking import TrackingSpec


class Store:
    """A run's MLflow store: `open` first (the store checked, the client opened, the experiment found or made),
    then the calls below on its runs."""

    def __init__(self) -> None:
        self.client: Any = None

    def open(self, uri: str, experiment: str, artifact_root: str) -> str:
        """The experiment's id. Raises SpecError (one line) for a store or an experiment runs cannot use."""
        check_tracking(TrackingSpec(uri=uri, experiment=experiment, artifact_root=artifact_root))
        self.client = open_client(uri)
        return open_experiment(self.client, experiment, uri, artifact_root)

    def run(self, run_id: str) -> dict[str, Any] | None:
        """The run's name, tags and lifecycle stage; None where the store holds no such run."""
        try:
            run = self.client.get_run(run_id)
        except Exception:  # noqa: BLE001  (no such run, or an id MLflow refuses: no run either way)
            return None
        return {"run_name": run.info.run_name, "tags": dict(run.data.tags), "stage": run.info.lifecycle_stage,
                "status": run.info.status}

    def logged_steps(self, run_id: str) -> dict[str, list[int]]:
        """Metric key -> the steps the run holds."""
        keys = self.client.get_run(run_id).data.metrics
        return {key: [m.step for m in self.client.get_metric_history(run_id, key)] for key in keys}

    def reattach(self, run_id: str, owner: dict[str, str]) -> str:
        """The run RUNNING again, kept so by the process `owner` names (an earlier ending is history); its name."""
        from mlflow.entities import RunTag

        self.client.update_run(run_id, status="RUNNING")
        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in owner.items()])
        run = self.client.get_run(run_id)
        if "runner.outcome" in run.data.tags:
            self.client.delete_tag(run_id, "runner.outcome")
        return run.info.run_name

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def set_terminated(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def log_metrics(self, run_id: str, metrics: list[tuple[str, float, int, int]]) -> None:
        """(key, value, ms since the epoch, step) values, in one log_batch (at most MLflow's 1000)."""
        from mlflow.entities import Metric

        self.client.log_batch(run_id, metrics=[Metric(k, v, ms, step) for k, v, ms, step in metrics])

    def make_call(self, run_id: str, kind: str, args: dict) -> dict:
        """A store call kept as data (runner/tracking/calls.py); its args as the call left them (a record built,
        a model's id once created: a retry goes on from there)."""
        make_call(self.client, run_id, kind, args)
        return args
