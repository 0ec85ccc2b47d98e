"""Tracking: every run lands in MLflow (rank 0 only), or nowhere with tracking=none.

MlflowClient is used rather than the fluent `mlflow.start_run` API: no process-global active run,
so parallel trials in one process and resumed runs each address their own run id.
Metrics cost the step loop a list append; every few seconds they go to MLflow's async logging queue
in batches, and `flush` stores them for good (the engine calls it before writing a checkpoint, so a
kill loses no step that a resume will not log again). A resumed run skips the (metric, step) pairs
its MLflow run already holds, so its history has every step once.
Store checks and the store lock live in runner.tracking.mlflow_store.
"""
from __future__ import annotations

import json
import logging
import re
import socket
import time
from pathlib import Path
from typing import Any, Protocol

from runner.spec import metric_names

from runner.tracking import run_record
from runner.tracking.mlflow_store import (DEFAULT_URI, check_tracking, experiment_page, open_client, open_experiment, owner_tags,
                                  saved_views, store_views)
from runner.spec.run import RunSpec, SpecError
from runner.spec.tracking import TrackingSpec

log = logging.getLogger(__name__)

RUN_FILE = "mlflow_run_id"
_FLUSH_EVERY_S = 5.0
_FLUSH_AT = 500  # metric values; MLflow takes at most 1000 per batch

__all__ = ["Tracker", "NullTracker", "MlflowTracker", "best_key", "build_tracker", "check_tracking", "end_left_running",
           "experiment_id", "open_client", "params_of", "run_exists", "run_name_from"]


class Tracker(Protocol):
    run_id: str | None

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_summary(self, objective: float, best: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str) -> None: ...
    def describe(self) -> str: ...


class NullTracker:
    """tracking=none, and every rank but 0."""

    run_id = None
    run_name = ""

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_summary(self, objective: float, best: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def flush(self) -> None: ...
    def finish(self, status: str) -> None: ...

    def describe(self) -> str:
        return "tracking is off (tracking=none)"


class MlflowTracker:
    def __init__(self, uri: str, experiment: str, artifact_root: str, parent_run_id: str | None = None,
                 run_file: Path | None = None):
        self.uri = uri
        self.client: Any = None  # opened in start, after the store is checked
        self.experiment = experiment
        self.artifact_root = artifact_root
        self.parent_run_id = parent_run_id
        self.run_file = run_file  # the run directory remembers its MLflow run: restarts reattach to it
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.run_name = ""
        self._buffer: list[tuple[int, int, dict[str, float]]] = []  # (step, ms timestamp, metrics)
        self._buffered = 0
        self._last_send = time.monotonic()
        self._pending: list = []
        self._logged: dict[str, set[int]] = {}  # steps the run already held when this tracker reattached

    def _check_parent(self, spec: RunSpec) -> None:
        """The parent run must be a live run of this store: MLflow would tag a child with any id, and the run
        would hang under nothing (or under a deleted run) in the UI."""
        try:
            parent = self.client.get_run(self.parent_run_id)
        except Exception:
            parent = None
        if parent is None or parent.info.lifecycle_stage == "deleted":
            what = "is no MLflow run" if parent is None else "is a deleted MLflow run"
            raise SpecError(f"{_parent_key(spec)}: {self.parent_run_id} {what} in {self.uri}; runner sets it for a "
                            "k-fold run's folds (leave trainer.cross_validation.parent_run unset)")

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None:
        check_tracking(TrackingSpec(uri=self.uri, experiment=self.experiment, artifact_root=self.artifact_root))
        self.client = open_client(self.uri)
        self.experiment_id = open_experiment(self.client, self.experiment, self.uri, self.artifact_root)
        maximize = spec.objective.direction == "maximize"
        store_views(self.client, self.experiment_id, saved_views(main_metrics(spec), maximize, spec.objective.metric))
        if not resume_run_id and self.run_file is not None and self.run_file.exists():
            resume_run_id = self.run_file.read_text().strip()
        if resume_run_id and run_exists(self.client, resume_run_id):
            self._logged = logged_steps(self.client, resume_run_id)
            self.run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
            self.set_tags(owner_tags())  # this process keeps it RUNNING now; an earlier ending is history
            run = self.client.get_run(resume_run_id)
            self.run_name = run.info.run_name
            if "runner.outcome" in run.data.tags:
                self.client.delete_tag(resume_run_id, "runner.outcome")
            self._last_send = time.monotonic()
            return
        self.run_name = spec.tracking.run_name or run_name_from(spec.overrides)
        tags = {"overrides": " ".join(spec.overrides) or "(none)",
                "host": socket.gethostname(), "run_dir": spec.run_dir, **owner_tags()}
        if self.parent_run_id:
            self._check_parent(spec)
            tags["mlflow.parentRunId"] = self.parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        try:  # from here on a failure must not leave the run RUNNING
            if self.run_file is not None:
                self.run_file.parent.mkdir(parents=True, exist_ok=True)
                self.run_file.write_text(self.run_id)
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in params_of(spec).items()]
            for i in range(0, len(params), 100):  # MLflow's limit per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            self.client.log_text(self.run_id, spec.to_yaml(), "spec.yaml")
            run_record.log(self.client, self.run_id, spec)  # commit, diff, packages, hardware, data: to reproduce it
        except BaseException:
            self.client.set_terminated(self.run_id, status="FAILED")
            raise
        self._last_send = time.monotonic()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._buffer.append((step, int(time.time() * 1000), dict(metrics)))
        self._buffered += len(metrics)
        if self._buffered >= _FLUSH_AT or time.monotonic() - self._last_send > _FLUSH_EVERY_S:
            self._send(synchronous=False)

    def log_summary(self, objective: float, best: dict[str, float], step: int) -> None:
        """The runs table shows a metric's last value; these columns rank runs by their best."""
        self.log_metrics({"objective": objective, **{best_key(k): v for k, v in best.items()}}, step)

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def log_text(self, text: str, artifact_file: str) -> None:
        """Called while a run fails (its traceback): a store error here must not hide that failure."""
        try:
            self.client.log_text(self.run_id, text, artifact_file)
        except Exception as e:
            log.warning("MLflow: could not store %s: %s", artifact_file, str(e).splitlines()[0] if str(e) else e)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def flush(self) -> None:
        """Store every metric logged so far, synchronously."""
        if self.run_id is None:
            return
        pending, self._pending = self._pending, []
        errors = []
        for operation in pending:
            try:
                operation.wait()
            except Exception as e:
                errors.append(e)
        self._send(synchronous=True)
        if errors:
            raise errors[0]

    def finish(self, status: str) -> None:
        """End the run; set_terminated is attempted even when the last metrics cannot be stored."""
        if self.run_id is None:
            return
        try:
            self.flush()
        except Exception as e:
            log.warning("MLflow: could not store the last metrics of run %s: %s", self.run_id,
                        str(e).splitlines()[0] if str(e) else e)
            self.client.set_terminated(self.run_id, status="FAILED")
            if status == "FINISHED":
                raise  # a run whose metrics are lost did not finish; an ending failure keeps its own error
            return
        self.client.set_terminated(self.run_id, status=status)

    def describe(self) -> str:
        if self.uri.startswith("http"):
            where = experiment_page(self.uri, self.experiment_id or "0")
        else:  # the link opens the runs table, not MLflow 3's GenAI overview
            ui = "make ui" if self.uri == DEFAULT_URI else f"python -m runner.tracking.mlflow_ui --backend-store-uri {self.uri}"
            where = f"{ui}, then {experiment_page('http://127.0.0.1:5000', self.experiment_id or '0')}"
        return f"MLflow run '{self.run_name}' ({self.run_id}) in experiment '{self.experiment}'; see it with: {where}"

    def _send(self, synchronous: bool) -> None:
        from mlflow.entities import Metric

        self._last_send = time.monotonic()
        batch, self._buffer, self._buffered = self._buffer, [], 0
        metrics = [Metric(k, float(v), ms, step) for step, ms, values in batch for k, v in values.items()
                   if step not in self._logged.get(k, ())]
        for i in range(0, len(metrics), 1000):
            op = self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000], synchronous=synchronous)
            if op is not None and not synchronous:
                self._pending.append(op)


def best_key(metric: str) -> str:
    """The summary metric holding metric's best value: 'val/acc' -> 'best_val_acc'. No '/' in it: the
    UI charts a run's metrics in sections named for the part before the last '/', sorted by name, with
    the names without one last; so the curves (train/, val/) come before these single values."""
    return "best_" + metric.replace("/", "_")


def main_metrics(spec: RunSpec) -> list[str]:
    """The runs table's columns: the objective, then what is evaluated (val/*, test/*), then train/loss."""
    try:
        during, at_end = metric_names.evaluation_metrics(spec)
    except Exception:  # noqa: BLE001  (an unknown task: the engine says so; the columns do without)
        during, at_end = set(), set()
    return ["objective", spec.objective.metric, *sorted(during), *sorted(at_end), "train/loss"]


def experiment_id(client: Any, name: str, uri: str, artifact_root: str) -> str:
    """The experiment's id, created on first use (kept for the sweeper's parent run)."""
    return open_experiment(client, name, uri, artifact_root)


def run_exists(client: Any, run_id: str) -> bool:
    try:
        client.get_run(run_id)
        return True
    except Exception:
        return False


def logged_steps(client: Any, run_id: str) -> dict[str, set[int]]:
    """Metric key -> the steps the run already holds."""
    keys = client.get_run(run_id).data.metrics
    return {key: {m.step for m in client.get_metric_history(run_id, key)} for key in keys}


def _parent_key(spec: RunSpec) -> str:
    return ("trainer.cross_validation.parent_run" if spec.trainer.cross_validation.parent_run
            else "the sweep's MLflow parent run")


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
    client = open_client(spec.tracking.uri, end_orphans=False)  # FAILED or KILLED: the launcher knows which
    run_id = run_file.read_text().strip()
    if run_exists(client, run_id) and client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, status=status)


# overrides that change where a run logs, shows progress, resumes from or reads its files with, not what it trains
_NOT_IN_NAME = ("hydra", "trial", "tracking", "trainer.progress_bar", "trainer.resume", "trainer.log_every_n_steps",
                "trainer.checkpoint_every_n_steps", "trainer.keep_checkpoints", "dataset.num_workers", "dataset.download",
                "parallelism.rdzv_endpoint", "parallelism.rdzv_timeout", "parallelism.node_rank",
                "parallelism.max_restarts")


def run_name_from(overrides: tuple[str, ...]) -> str:
    """A readable name from the overrides that change what is trained:
    'optimizer=adamw precision=bf16 +accum=4 tracking.uri=...' -> 'adamw,bf16,accum=4'."""
    parts = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if any(key == k or key.startswith((f"{k}.", f"{k}/")) for k in _NOT_IN_NAME):
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


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def params_of(spec: RunSpec) -> dict[str, str]:
    """MLflow params: the spec flattened to dotted keys, each a valid MLflow key whatever a user's keys hold.

    A mapping is flattened only where every key is a plain name; one whose keys are not (a glob such as
    `backbone.*`, which MLflow refuses in a key; a dotted key, whose flat name could collide with a nested
    one's) is one param holding the mapping as JSON: readable, and json.loads gives it back."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node and all(isinstance(k, str) and _PLAIN_KEY.match(k) for k in node):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = _param_value(node)

    walk({k: v for k, v in spec.to_dict().items() if k != "overrides"}, "")  # overrides: a tag
    return out


def _param_value(value: Any) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
    return text[:6000]  # MLflow's limit
