"""A run's calls on an existing MLflow sqlite store, made with Python's sqlite3 instead of MLflow.

Why not MLflow here: importing it and opening a store costs 1.2-3 s of CPU per run (MLflow imports pandas,
alembic with every SQL dialect, FastAPI and its GenAI modules; its store module cannot be imported without
them), more than everything else tracking does. A run on an existing sqlite store needs a few inserts and
updates, so those are made here, writing the rows MLflow's SqlAlchemyStore writes for the same calls
(create_run, log_batch, set_terminated, set_experiment_tag, log_text and log_artifact on a local artifact
location), with its checks (names, lengths, a param never changed, an active run). Only a store whose schema
is one this module was checked against (`SCHEMAS`: the alembic revision tests/tracking compare with
MLflow's own head) is written this way; any other store, a fresh file (MLflow creates and migrates it), an
experiment to create, runs left RUNNING by a dead process to end, and every call not made here (a resume's
reads, a logged model) go through MLflow as before (runner/tracking/store.py), so nothing a run logs
depends on which way it went.
"""
from __future__ import annotations

import math
import posixpath
import re
import shutil
import socket
import sqlite3
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

from runner.specs.tracking import TrackingSpec
from runner.tracking import mlflow_store

# alembic revisions of MLflow's sqlite schema whose tables this module writes as MLflow does (MLflow 3.17)
SCHEMAS = {"dc11669786a5"}
_NAME = re.compile(r"^[/\w.\- :]*$")  # MLflow's valid metric, param and tag names (POSIX)
_KEY_MAX, _PARAM_MAX, _TAG_MAX, _EXPERIMENT_TAG_MAX = 250, 6000, 8000, 20000
_FLOAT_MAX = 1.7976931348623157e308
RUN_NAME_TAG = "mlflow.runName"
_BUSY_S = 5.0  # sqlite's busy timeout, as SQLAlchemy's default for MLflow's engine


class Refused(ValueError):
    """A call MLflow would refuse (INVALID_PARAMETER_VALUE): not retried (runner/tracking/writer.py)."""

    refused = True
    error_code = "INVALID_PARAMETER_VALUE"


def usable(uri: str) -> bool:
    """Whether uri is an existing sqlite store of a schema this module writes (a few ms; never raises)."""
    path = mlflow_store.sqlite_path(uri) if uri.startswith("sqlite:") else None
    if path is None or not path.is_file():
        return False
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=_BUSY_S)
        try:
            versions = {row[0] for row in db.execute("SELECT version_num FROM alembic_version")}
            return bool(versions) and versions <= SCHEMAS  # none: a file MLflow never migrated
        finally:
            db.close()
    except sqlite3.Error:
        return False


def opened(uri: str, experiment: str, artifact_root: str) -> "SqliteStore | None":
    """The store opened here, or None where MLflow must open it (see the module's docstring)."""
    if not usable(uri):
        return None
    try:
        store = SqliteStore(uri)
        if store.open(uri, experiment, artifact_root) is None:
            store.close()
            return None
        return store
    except Exception:  # noqa: BLE001  (MLflow opens it and says what is wrong, as before)
        return None


class SqliteStore:
    """runner/tracking/store.py's calls on an MLflow sqlite store; the calls not made here by MLflow's."""

    def __init__(self, uri: str):
        self.uri = uri
        self.db = sqlite3.connect(str(mlflow_store.sqlite_path(uri)), timeout=_BUSY_S, isolation_level=None,
                                  check_same_thread=False)  # the main thread opens, the writer's thread writes
        self.lock = threading.Lock()
        self.experiment_id: str | None = None
        self.closed = False
        self._mlflow: Any = None  # runner/tracking/store.py's Store, opened where a call needs it

    def open(self, uri: str, experiment: str, artifact_root: str) -> str | None:
        """The experiment's id; None where MLflow must open the store (the experiment to be created or tagged,
        a non-local artifact location, runs of dead processes to end)."""
        mlflow_store.check_tracking(TrackingSpec(uri=uri, experiment=experiment, artifact_root=artifact_root))
        row = self.db.execute("SELECT experiment_id, artifact_location, lifecycle_stage FROM experiments "
                              "WHERE name = ? AND workspace = 'default'", (experiment,)).fetchone()
        if row is None or row[2] != "active" or not str(row[1] or "").startswith("file:"):
            return None
        experiment_id = str(row[0])
        kind = self.db.execute("SELECT value FROM experiment_tags WHERE experiment_id = ? AND key = ?",
                               (experiment_id, mlflow_store.EXPERIMENT_KIND_TAG)).fetchone()
        if not kind or not kind[0] or self._orphans():
            return None
        mlflow_store.check_artifact_location(row[1])
        self.experiment_id = experiment_id
        return experiment_id

    def _orphans(self) -> bool:
        """Whether a RUNNING run of this host names a process that is gone (MLflow's opening ends it)."""
        rows = self.db.execute(
            "SELECT p.value, s.value FROM runs r JOIN tags h ON h.run_uuid = r.run_uuid AND h.key = ? "
            "JOIN tags p ON p.run_uuid = r.run_uuid AND p.key = ? LEFT JOIN tags s ON s.run_uuid = r.run_uuid "
            "AND s.key = ? WHERE r.status = 'RUNNING' AND h.value = ?",
            (mlflow_store.HOST_TAG, mlflow_store.PID_TAG, mlflow_store.STARTED_TAG, socket.gethostname())).fetchall()
        return any(pid.isdigit() and mlflow_store.process_gone(int(pid), started or None) for pid, started in rows)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.db.close()

    # --- the calls ----------------------------------------------------------------------------------

    def run(self, run_id: str) -> dict[str, Any] | None:
        with self.lock:
            row = self.db.execute("SELECT name, lifecycle_stage, status FROM runs WHERE run_uuid = ?",
                                  (run_id,)).fetchone()
            if row is None:
                return None
            tags = dict(self.db.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)).fetchall())
        return {"run_name": row[0], "tags": tags, "stage": row[1], "status": row[2]}

    def create_run(self, experiment_id: str, run_name: str, tags: dict[str, str]) -> str:
        checked = [_tag(k, v) for k, v in tags.items()]
        run_name = run_name or tags.get(RUN_NAME_TAG) or ""
        if not run_name:  # MLflow would draw a random name: its own call then
            return self._delegate().create_run(experiment_id, run_name, tags)
        if RUN_NAME_TAG not in tags:
            checked.append((RUN_NAME_TAG, run_name))
        run_id = uuid.uuid4().hex
        with self.lock, self._write():
            location, stage = self.db.execute("SELECT artifact_location, lifecycle_stage FROM experiments WHERE "
                                              "experiment_id = ?", (experiment_id,)).fetchone()
            if stage != "active":
                raise Refused(f"The experiment {experiment_id} must be in the 'active' state.")
            self.db.execute(
                "INSERT INTO runs (run_uuid, name, source_type, source_name, entry_point_name, user_id, status, "
                "start_time, end_time, source_version, lifecycle_stage, artifact_uri, experiment_id, deleted_time) "
                "VALUES (?, ?, 'UNKNOWN', '', '', ?, 'RUNNING', ?, NULL, '', 'active', ?, ?, NULL)",
                (run_id, run_name, tags.get("mlflow.user", "unknown"), _now_ms(),
                 f"{location.rstrip('/')}/{run_id}/artifacts", int(experiment_id)))
            self.db.executemany("INSERT OR REPLACE INTO tags (key, value, run_uuid) VALUES (?, ?, ?)",
                                [(k, v, run_id) for k, v in checked])
        return run_id

    def set_terminated(self, run_id: str, status: str) -> None:
        with self.lock, self._write():
            self._active(run_id)
            self.db.execute("UPDATE runs SET status = ?, end_time = ? WHERE run_uuid = ?", (status, _now_ms(), run_id))

    def log_metrics(self, run_id: str, metrics: list[tuple[str, float, int, int]]) -> None:
        """(key, value, ms, step) values: rows of `metrics`, and `latest_metrics` moved where a value is newer
        (by step, then time, then value), as MLflow's log_batch."""
        rows = []
        if not metrics:
            return
        for key, value, ms, step in metrics:
            _name(key, "metric")
            is_nan = math.isnan(value)
            value = 0.0 if is_nan else max(-_FLOAT_MAX, min(_FLOAT_MAX, value))
            rows.append((key, value, int(ms), run_id, int(step), int(is_nan)))
        with self.lock, self._write():
            self._active(run_id)
            self.db.executemany("INSERT OR IGNORE INTO metrics (key, value, timestamp, run_uuid, step, is_nan) "
                                "VALUES (?, ?, ?, ?, ?, ?)", rows)
            newest: dict[str, tuple] = {}
            for key, value, ms, _, step, is_nan in rows:
                if key not in newest or (step, ms, value) > newest[key][:3]:
                    newest[key] = (step, ms, value, is_nan)
            held = {key: (step, ms, value) for key, step, ms, value in self.db.execute(
                f"SELECT key, step, timestamp, value FROM latest_metrics WHERE run_uuid = ? AND key IN "
                f"({','.join('?' * len(newest))})", (run_id, *newest))}
            self.db.executemany(
                "INSERT OR REPLACE INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(key, value, ms, step, is_nan, run_id) for key, (step, ms, value, is_nan) in newest.items()
                 if key not in held or (step, ms, value) > held[key]])

    def make_call(self, run_id: str, kind: str, args: dict) -> dict:
        """runner/tracking/calls.py's calls; those not made here (a model, a record to build from the run's
        spec.yaml, a folder as artifact), by MLflow."""
        if kind == "params":
            self._params(run_id, args["params"])
        elif kind == "tags":
            self._tags(run_id, args["tags"])
        elif kind == "text":
            self._write_artifact(run_id, args["file"], text=args["text"])
        elif kind == "artifact" and Path(args["path"]).is_file():
            self._write_artifact(run_id, posixpath.join(args.get("artifact_path") or "", Path(args["path"]).name),
                                 source=Path(args["path"]))
        elif kind == "record" and "tags" in args:
            self._tags(run_id, {k: v[:5000] for k, v in args["tags"].items()})
            for file, text in args["texts"].items():
                self._write_artifact(run_id, file, text=text)
        elif kind == "views":
            mlflow_store.store_views(_ExperimentTags(self), args["experiment_id"], args["views"])
        else:
            return self._delegate().make_call(run_id, kind, args)
        return args

    def logged_steps(self, run_id: str) -> dict[str, list[int]]:
        return self._delegate().logged_steps(run_id)

    def reattach(self, run_id: str, owner: dict[str, str]) -> str:
        return self._delegate().reattach(run_id, owner)

    # --- helpers ------------------------------------------------------------------------------------

    def _delegate(self) -> Any:
        if self._mlflow is None:
            from runner.tracking.store import Store

            store = Store()
            store.client = mlflow_store.open_client(self.uri)
            self._mlflow = store
        return self._mlflow

    def _write(self) -> sqlite3.Connection:
        """A write transaction (BEGIN IMMEDIATE: the file's write lock from the start, so two writers never
        deadlock upgrading read locks), committed on leaving, rolled back on an error."""
        self.db.execute("BEGIN IMMEDIATE")
        return _Transaction(self.db)

    def _active(self, run_id: str) -> str:
        row = self.db.execute("SELECT lifecycle_stage, artifact_uri FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
        if row is None:
            raise Refused(f"Run with id={run_id} not found")
        if row[0] != "active":
            raise Refused(f"The run {run_id} must be in the 'active' state. Current state is {row[0]}.")
        return row[1]

    def _params(self, run_id: str, params: dict[str, Any]) -> None:
        values = {}
        for key, value in params.items():
            _name(key, "param")
            value = str(value)
            if len(value) > _PARAM_MAX:
                raise Refused(f"Param value '{value[:100]}...' had length {len(value)}, which exceeded length limit "
                              f"of {_PARAM_MAX}")
            values[key] = value
        with self.lock, self._write():
            self._active(run_id)
            held = dict(self.db.execute("SELECT key, value FROM params WHERE run_uuid = ?", (run_id,)).fetchall())
            changed = {k: (held[k], v) for k, v in values.items() if k in held and held[k] != v}
            if changed:
                raise Refused(f"Changing param values is not allowed. Params were already logged='{changed}' for "
                              f"run ID='{run_id}'.")
            self.db.executemany("INSERT INTO params (key, value, run_uuid) VALUES (?, ?, ?)",
                                [(k, v, run_id) for k, v in values.items() if k not in held])

    def _tags(self, run_id: str, tags: dict[str, str]) -> None:
        checked = [_tag(k, str(v)) for k, v in tags.items()]
        with self.lock, self._write():
            self._active(run_id)
            self.db.executemany("INSERT OR REPLACE INTO tags (key, value, run_uuid) VALUES (?, ?, ?)",
                                [(k, v, run_id) for k, v in checked])
            for key, value in checked:
                if key == RUN_NAME_TAG:  # MLflow renames the run with its tag
                    self.db.execute("UPDATE runs SET name = ? WHERE run_uuid = ?", (value, run_id))

    def _write_artifact(self, run_id: str, file: str, text: str | None = None, source: Path | None = None) -> None:
        with self.lock:
            root = self._active(run_id)
        parsed = urllib.parse.urlsplit(root)
        target = Path(urllib.parse.unquote(parsed.path)) / file
        target.parent.mkdir(parents=True, exist_ok=True)
        if source is not None:
            shutil.copy2(source, target)
        else:
            target.write_text(text, encoding="utf-8")


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, kind, *_) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


class _ExperimentTags:
    """What mlflow_store.store_views asks of a client: an experiment's tags, read and set."""

    def __init__(self, store: SqliteStore):
        self.store = store

    def get_experiment(self, experiment_id: str) -> Any:
        with self.store.lock:
            rows = self.store.db.execute("SELECT key, value FROM experiment_tags WHERE experiment_id = ?",
                                         (int(experiment_id),)).fetchall()
        return type("Experiment", (), {"tags": dict(rows)})

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None:
        _name(key, "tag")
        if len(key) > _KEY_MAX or len(value) > _EXPERIMENT_TAG_MAX:
            raise Refused(f"experiment tag {key!r} is longer than MLflow allows")
        with self.store.lock, self.store._write():
            self.store.db.execute("INSERT OR REPLACE INTO experiment_tags (key, value, experiment_id) VALUES (?, ?, ?)",
                                  (key, value, int(experiment_id)))


def _name(key: str, what: str) -> None:
    if not isinstance(key, str) or not _NAME.match(key):
        raise Refused(f"Invalid {what} name: {key!r}. Names may only contain alphanumerics, underscores (_), dashes "
                      "(-), periods (.), spaces ( ), colon(:) and slashes (/).")
    norm = posixpath.normpath(key)
    if norm != key or norm == "." or norm.startswith("..") or norm.startswith("/"):
        raise Refused(f"Invalid {what} name: {key!r}. Names may be treated as files in certain cases, and must not "
                      f"resolve to other names when treated as such.")
    if len(key) > _KEY_MAX:
        raise Refused(f"{what} name {key[:100]!r}... exceeds the maximum length of {_KEY_MAX}")


def _tag(key: str, value: str) -> tuple[str, str]:
    _name(key, "tag")
    return key, value[:_TAG_MAX]  # MLflow truncates a run tag's value


def _now_ms() -> int:
    return int(time.time() * 1000)
