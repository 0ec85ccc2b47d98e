"""Tracking: every run lands in MLflow (rank 0 only), or nowhere with tracking=none.

MlflowClient is used rather than the fluent `mlflow.start_run` API: no process-global active run,
so parallel trials in one process and resumed runs each address their own run id.
Metrics are buffered in the step loop and sent in batches from MLflow's async logging queue, so
logging costs the step loop a list append.
"""
from __future__ import annotations

import logging
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol

from runner.spec import RunSpec

log = logging.getLogger(__name__)

RUN_FILE = "mlflow_run_id"
_FLUSH_EVERY_S = 5.0
_FLUSH_AT = 500  # metric values; MLflow takes at most 1000 per batch


class Tracker(Protocol):
    run_id: str | None

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def finish(self, status: str) -> None: ...
    def describe(self) -> str: ...


class NullTracker:
    """tracking=none, and every rank but 0."""

    run_id = None
    run_name = ""

    def flush(self) -> None: ...
    def log_summary(self, objective: float, best: dict[str, float], step: int) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def finish(self, status: str) -> None: ...

    def describe(self) -> str:
        return "tracking is off (tracking=none)"


class MlflowTracker:
    def __init__(self, uri: str, experiment: str, artifact_root: str, parent_run_id: str | None = None,
                 run_file: Path | None = None):
        for name in ("alembic", "mlflow.store.db.utils", "mlflow.tracking"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment = experiment
        self.artifact_root = artifact_root
        self.parent_run_id = parent_run_id
        self.run_file = run_file  # the run directory remembers its MLflow run: restarts reattach to it
        self.run_id: str | None = None
        self.run_name = ""
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._pending: list = []

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None:
        experiment = experiment_id(self.client, self.experiment, self.uri, self.artifact_root)
        if not resume_run_id and self.run_file is not None and self.run_file.exists():
            resume_run_id = self.run_file.read_text().strip()
        if resume_run_id and run_exists(self.client, resume_run_id):
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            self.run_name = self.client.get_run(resume_run_id).info.run_name
            return
        self.run_name = spec.tracking.run_name or run_name_from(spec.overrides)
        tags = {"overrides": " ".join(spec.overrides) or "(none)", "git_commit": _git_commit(),
                "host": socket.gethostname(), "run_dir": spec.run_dir}
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        run = self.client.create_run(experiment, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        if self.run_file is not None:
            self.run_file.parent.mkdir(parents=True, exist_ok=True)
            self.run_file.write_text(self.run_id)
        from mlflow.entities import Param

        params = [Param(k, _param_value(v)) for k, v in spec.flat().items() if k != "overrides"]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, spec.to_yaml(), "spec.yaml")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        if len(self._buffer) >= _FLUSH_AT or time.monotonic() - self._last_flush > _FLUSH_EVERY_S:
            self._flush(synchronous=False)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def flush(self) -> None:
        self._flush(synchronous=True)

    def log_summary(self, objective: float, best: dict[str, float], step: int) -> None:
        self.log_metrics({"objective": objective, **{f"best/{k}": v for k, v in best.items()}}, step)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def finish(self, status: str) -> None:
        if self.run_id is None:
            return
        try:
            self._flush(synchronous=True)
            for operation in self._pending:
                operation.wait()
        finally:
            self.client.set_terminated(self.run_id, status=status)

    def describe(self) -> str:
        ui = f"mlflow ui --backend-store-uri {self.uri}" if not self.uri.startswith("http") else self.uri
        return f"MLflow run '{self.run_name}' ({self.run_id}) in experiment '{self.experiment}'; see it with: make ui  ({ui})"

    def _flush(self, synchronous: bool) -> None:
        self._last_flush = time.monotonic()
        batch, self._buffer = self._buffer, []
        for i in range(0, len(batch), 1000):
            op = self.client.log_batch(self.run_id, metrics=batch[i:i + 1000], synchronous=synchronous)
            if op is not None and not synchronous:
                self._pending.append(op)


def experiment_id(client: Any, name: str, uri: str, artifact_root: str) -> str:
    """The experiment's id, created on first use (artifacts under artifact_root on a local store)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if not uri.startswith(("http", "databricks")):
        location = Path(artifact_root).resolve().as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # another process created it first
        return client.get_experiment_by_name(name).experiment_id


def run_exists(client: Any, run_id: str) -> bool:
    try:
        client.get_run(run_id)
        return True
    except Exception:
        return False


def build_tracker(spec: RunSpec, rank: int = 0, parent_run_id: str | None = None) -> Tracker:
    if spec.tracking.name == "none" or rank != 0:
        return NullTracker()
    t = spec.tracking
    return MlflowTracker(t.uri, t.experiment, t.artifact_root, parent_run_id, Path(spec.run_dir) / RUN_FILE)


def end_left_running(spec: RunSpec, status: str) -> None:
    """Workers that died cannot end their MLflow run; the launcher does it for them."""
    run_file = Path(spec.run_dir) / RUN_FILE
    if spec.tracking.name == "none" or not run_file.exists():
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=spec.tracking.uri)
    run_id = run_file.read_text().strip()
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, status=status)


def run_name_from(overrides: tuple[str, ...]) -> str:
    """A readable name from the overrides: 'optimizer=adamw precision=bf16 +accum=4' -> 'adamw,bf16,accum=4'."""
    parts = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith(("hydra.", "trial.")) or key in ("trainer.resume", "tracking.uri"):
            continue
        value = _short_number(value)
        parts.append(value if "." not in key and key not in ("seed", "accum") else f"{key.split('.')[-1]}={value}")
    return ",".join(parts)[:200] or "default"


def _short_number(value: str) -> str:
    """Sampled floats read as 0.0083, not 0.008313101133778738."""
    try:
        return value if float(value).is_integer() else f"{float(value):.3g}"
    except ValueError:
        return value


def _param_value(value: Any) -> str:
    return str(value)[:6000]


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
        return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
