"""Is the MLflow store usable, and safe to open from several processes at once?

`check_tracking` answers the first within a few seconds, importing neither torch nor MLflow, so bad
tracking input fails in one line before training: MLflow's own client retries an unreachable server
for minutes and fails a read-only or full store with a long traceback.

`open_client` is the one way into the store, for runs, trials and parent runs alike. It serialises
MLflow's first open of a sqlite store behind a file lock: MLflow migrates a fresh sqlite file on
first open, and several processes migrating one file at once break it ("duplicate column name",
"_alembic_tmp_metrics already exists"), sometimes for good. And it ends the runs whose process is
gone (`end_orphaned_runs`): every run records its process in `owner_tags`, so a run whose process
was killed (kill -9, a lost sweep) ends KILLED at the next start of any command on the store, with the
metrics its run directory's journal holds and the store lacks logged first; a run whose process ended
while the store could not be reached ends as its journal says (FINISHED, FAILED, KILLED).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import socket
import ssl
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from runner.specs.run import SpecError
from runner.specs.tracking import TrackingSpec

log = logging.getLogger(__name__)

# MLflow 3.x before 3.17 picks its model-training view (runs table) or its GenAI view (traces
# overview) per experiment from this tag (values: the UI's ExperimentKind enum). The 3.17 UI ignores
# it: one switch per browser decides (localStorage WORKFLOW_STORAGE_KEY, default GenAI), which the
# workflowType URL parameter overrides for one page; runner.tracking.mlflow_ui presets it for `make ui`.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
WORKFLOW_STORAGE_KEY, MACHINE_LEARNING = "mlflow.workflowType_v1", "machine_learning"
# The UI's saved views (its "Views" menu, and the viewStateShareKey URL parameter) are experiment tags
# named VIEW_TAG_PREFIX + id. runner keeps two: its main metrics as columns, newest run first (parents
# with their children nested: MLflow nests only in that order), and the same sorted best run first.
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
RUNS_VIEW, BEST_VIEW = "runner-runs", "runner-best"
DEFAULT_URI = "sqlite:///outputs/mlflow.db"

_PROBE_TIMEOUT_S = 5.0  # long enough for a slow but working server; short next to MLflow's retries
_LOCK_WAIT_S = 600.0    # a first migration takes seconds; a holder this slow is stuck
_DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
_SERVER_SCHEMES = {"databricks", "databricks-uc", "uc"}
_READ_ONLY = {errno.EACCES, errno.EPERM, errno.EROFS}
_FULL = {errno.ENOSPC, errno.EDQUOT}
PID_TAG, HOST_TAG, STARTED_TAG = "runner.pid", "runner.host", "runner.pid_started"  # see owner_tags
_cleaned: set[str] = set()  # stores whose orphaned runs this process has ended
_checked_for_run: tuple[str, str, str] | None = None  # (uri, artifact_root, cwd): see check_tracking's for_the_run


def check_tracking(tracking: TrackingSpec, for_the_run: bool = False) -> None:
    """Raise SpecError (one line) unless runs can be logged to tracking.uri and tracking.artifact_root.
    for_the_run: this is the check of the one run this process starts now (preflight's, before a single run);
    the same store's checks by that run's launch and tracker, moments later, then pass without probing it again
    (each probe is a write and an fsync: 5-10 ms of a run's start-up apiece)."""
    global _checked_for_run
    if tracking.name == "none":
        return
    checked = (tracking.uri, tracking.artifact_root, os.getcwd())  # relative paths are the working directory's
    if checked == _checked_for_run:
        return
    _check_tracking(tracking)
    if for_the_run:
        _checked_for_run = checked


def _check_tracking(tracking: TrackingSpec) -> None:
    uri = tracking.uri
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""
    if scheme in ("http", "https"):
        _probe_server(uri)
        return
    if scheme in _SERVER_SCHEMES:
        return
    if scheme == "sqlite":
        path = sqlite_path(uri)
        if path is not None:
            _check_sqlite_file(path, default=uri == DEFAULT_URI)
    elif scheme in _DB_PORTS:
        _probe_database(uri)
    elif scheme in ("", "file"):
        path = Path(urllib.parse.urlsplit(uri).path if scheme else uri)
        _check_writable(path, "tracking.uri", f"the MLflow store {path}", "point tracking.uri at a writable place")
    elif scheme not in _plugin_schemes():
        raise SpecError(f"tracking.uri: {uri!r} has an unknown scheme {scheme + ':'!r}; use sqlite:///<file> "
                        f"(default {DEFAULT_URI}), http(s)://<mlflow server>, postgresql://, mysql:// or a directory")
    check_artifact_location(tracking.artifact_root)


def check_artifact_location(location: str) -> None:
    """A local artifact location must be writable: MLflow would fail only at the first artifact, mid-run."""
    parsed = urllib.parse.urlsplit(location)
    if parsed.scheme not in ("", "file"):
        return  # a remote artifact store (s3://, mlflow-artifacts:, ...) answers for itself
    path = Path(urllib.parse.unquote(parsed.path) if parsed.scheme else location)
    _check_writable(path, "tracking.artifact_root", f"MLflow artifacts to {path}",
                    "make it writable or set tracking.artifact_root to a writable directory "
                    "(an experiment keeps the location it was created with: use a new tracking.experiment)")


def sqlite_path(uri: str) -> Path | None:
    """The file of a sqlite:/// uri; None for an in-memory database."""
    rest = uri.split(":", 1)[1] if uri.startswith("sqlite") else ""
    if not rest.startswith("///"):
        return None
    path = rest[3:].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock file next to a sqlite store (no-op for other stores)."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a") as lock:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SpecError(f"tracking.uri: another process has held {lock_path} for over "
                                    f"{_LOCK_WAIT_S:.0f} s; stop it or delete the lock file") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def open_client(uri: str, end_orphans: bool = True) -> Any:
    """An MlflowClient on uri. Constructing one opens the store (creating and migrating a fresh sqlite
    file), so it happens under the store's lock: several runs may start at once. The first open in a
    process also ends the store's orphaned runs (end_orphans=False: a caller that ends a dead
    process's run itself, with the status it knows)."""
    # migration steps log at INFO; and SQLAlchemy logs every statement at INFO wherever its level is unset:
    # MLflow sets it to WARNING once, at import, and a job's fresh process state (a reused joblib worker's
    # second job, runner/cli/process_state.py) unsets it again, so each opening sets it
    for name in ("alembic", "mlflow.store.db.utils", "mlflow.tracking", "sqlalchemy.engine"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlflow.tracking import MlflowClient

    with store_lock(uri):
        try:
            client = MlflowClient(tracking_uri=uri)
        except Exception as e:  # a broken or foreign file: MLflow's message, on one line
            raise SpecError(f"tracking.uri: cannot open the MLflow store {_masked(uri)} ({_first_line(e)}); "
                            f"fix or move it, or use another tracking.uri") from None
    if end_orphans and uri not in _cleaned:
        _cleaned.add(uri)
        end_orphaned_runs(client)
    return client


def owner_tags() -> dict[str, str]:
    """Tags naming the process that keeps a run RUNNING (set when it creates or reattaches to the run)."""
    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname(), STARTED_TAG: _started(os.getpid()) or ""}


def end_orphaned_runs(client: Any) -> list[str]:
    """End KILLED (tagged runner.outcome=killed) every RUNNING run of the store whose process, on this
    host, is gone; the ids of those runs. What the run's journal holds and the store lacks is logged first,
    and a run that ended while the store could not be reached ends as its journal says (complete_from_journal). Runs of other hosts, and runs without owner tags, are left
    alone. Never raises: a store that cannot be searched must not stop a run from starting."""
    from mlflow.entities import ViewType

    host, ended = socket.gethostname(), []
    try:
        experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        query, token = f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'", None
        while experiments:
            page = client.search_runs(experiments, query, ViewType.ALL, max_results=1000, page_token=token)
            for run in page:
                tags = run.data.tags
                if tags.get(PID_TAG, "").isdigit() and process_gone(int(tags[PID_TAG]), tags.get(STARTED_TAG) or None):
                    status, added, made, path = complete_from_journal(client, run)
                    if status is None:
                        client.set_tag(run.info.run_id, "runner.outcome", "killed")
                    client.set_terminated(run.info.run_id, status=status or "KILLED")
                    ended.append(run.info.run_id)
                    what = [f"{added} metric values"] if added else []
                    what += [f"{len(made)} other calls ({', '.join(dict.fromkeys(made))})"] if made else []
                    logged = f"; {' and '.join(what)} it lacked logged from {path}" if what else ""
                    if status is None:
                        log.warning(f"MLflow: run '{run.info.run_name}' ({run.info.run_id}) was left RUNNING by process "
                                    f"{tags[PID_TAG]}, which is gone: ended KILLED{logged}")
                    else:
                        log.warning(f"MLflow: run '{run.info.run_name}' ({run.info.run_id}) ended {status} while this "
                                    f"store could not be reached: completed now{logged}")
            token = page.token
            if not token:
                break
    except Exception as e:  # noqa: BLE001
        log.warning(f"MLflow: could not look for runs left RUNNING by killed processes ({_first_line(e)})")
    return ended


def complete_from_journal(client: Any, run: Any) -> tuple[str | None, int, list[str], Path | None]:
    """A run its process left RUNNING: the metrics its run directory's journal holds (runner/tracking/journal.py)
    and the store lacks, logged, and the other calls (params, tags, artifacts, the model) the store never
    confirmed, made. Returns the status the journal says the run ended with (None: it did not end, it was
    killed), the number of values logged, the kinds of the calls made, and the journal."""
    from mlflow.entities import Metric

    from runner.tracking import journal

    run_id, run_dir = run.info.run_id, run.data.tags.get("run_dir")
    path = Path(run_dir) / journal.FILE if run_dir else None
    entries = journal.read(path, run_id) if path is not None else None
    if entries is None:
        return None, 0, [], path
    held = {key: {m.step for m in client.get_metric_history(run_id, key)} for key in run.data.metrics}
    missing = []
    for step, ms, values in entries:
        for key, value in values.items():
            if step not in held.setdefault(key, set()):
                held[key].add(step)
                missing.append(Metric(key, value, ms, step))
    for i in range(0, len(missing), 1000):  # MLflow's limit per batch
        client.log_batch(run_id, metrics=missing[i:i + 1000])
    made = []
    for op, kind, args in journal.calls(path, run_id):
        try:
            make_call(client, run_id, kind, args)
            made.append(kind)
        except Exception as e:  # noqa: BLE001  (the store answers: this call's own trouble, a file gone, say)
            log.warning(f"MLflow: run {run_id}: could not make its {kind} call from {path} ({_first_line(e)}); "
                        "left out")
        journal.confirm(path, op)
    return journal.ended(path, run_id), len(missing), made, path


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, Linux): with the pid it names one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_gone(pid: int, started: str | None) -> bool:
    """Whether process pid (started at `started`) has ended: no such pid, a zombie, or a pid reused."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's live process
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False  # no /proc: the pid answers, so it is taken as alive
    return fields[0] in ("Z", "X") or (started is not None and fields[19] != started)


def open_experiment(client: Any, name: str, uri: str, artifact_root: str) -> str:
    """The experiment's id, created on first use (under the store's lock) and marked as model training."""
    local = not uri.startswith(("http", "databricks"))
    with store_lock(uri):
        found = client.get_experiment_by_name(name)
        if found is None:
            location = Path(artifact_root).resolve().as_uri() if local else None
            if location:
                check_artifact_location(location)
            try:
                return client.create_experiment(name, artifact_location=location,
                                                tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING})
            except Exception:  # a server store: another process created it first
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage == "deleted":
            raise SpecError(f"tracking.experiment: MLflow experiment {name!r} is deleted; restore it with "
                            f"`mlflow experiments restore --experiment-id {found.experiment_id}` or pick another name")
        if not found.tags.get(EXPERIMENT_KIND_TAG):
            client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        if local and found.artifact_location:
            check_artifact_location(found.artifact_location)
        return found.experiment_id


def experiment_page(base_url: str, experiment_id: str, view: str | None = RUNS_VIEW) -> str:
    """The experiment's runs table in runner's saved view (None: the browser's own): the model-training
    view whatever the browser's switch says (see EXPERIMENT_KIND_TAG), its main metrics as columns."""
    shared = f"&viewStateShareKey={view}" if view else ""
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType={MACHINE_LEARNING}{shared}"


def best_view(metric: str) -> str:
    """The id of the "best first" view of the runs whose objective is `metric`: one view per objective, so a
    language model's run never turns the classifiers' view (its order, its columns) into its own."""
    return f"{BEST_VIEW}-{re.sub(r'[^A-Za-z0-9]+', '-', metric).strip('-').lower()}"


def saved_views(columns: list[str], maximize: bool, metric: str | None = None) -> dict[str, dict[str, Any]]:
    """runner's saved views (view id -> the UI's state): the metrics `columns` shown, newest first, or
    best first among the runs of the objective `metric` (descending objective when it is maximized,
    ascending when minimized; without a metric, BEST_VIEW over every run)."""
    shown = [f"metrics.`{name}`" for name in dict.fromkeys(columns)]
    best = {"orderByKey": "metrics.`objective`", "orderByAsc": not maximize, "selectedColumns": shown}
    if metric is None:
        return {RUNS_VIEW: {"orderByKey": "attributes.start_time", "orderByAsc": False, "selectedColumns": shown},
                BEST_VIEW: best}
    return {RUNS_VIEW: {"orderByKey": "attributes.start_time", "orderByAsc": False, "selectedColumns": shown},
            best_view(metric): {**best, "searchFilter": f"params.`objective.metric` = '{metric}'"}}


def make_call(client: Any, run_id: str, kind: str, args: dict[str, Any]) -> None:
    """One store call kept as data (runner/tracking/calls.py), made; the runs table's views are this module's
    (calls.py stays below it, so the store and its calls import each other one way only)."""
    from runner.tracking import calls

    if kind == "views":
        store_views(client, args["experiment_id"], args["views"])
    else:
        calls.make(client, run_id, kind, args)


def store_views(client: Any, experiment_id: str, views: dict[str, dict[str, Any]]) -> None:
    """Write runner's saved views to the experiment where they differ from what it holds (the last run
    to start sets them: its metrics, its objective's direction). Never raises: a view is a convenience."""
    names = {RUNS_VIEW: "runner: newest first", BEST_VIEW: "runner: best objective first"}
    for view, state in views.items():
        if view.startswith(BEST_VIEW + "-"):
            names[view] = f"runner: best {state['searchFilter'].split(chr(39))[1]} first"
    try:
        tags, now = client.get_experiment(experiment_id).tags, int(time.time() * 1000)
        for order, (view, state) in enumerate(views.items()):
            held = _view_state(tags.get(VIEW_TAG_PREFIX + view))
            if view == RUNS_VIEW and held is not None:  # every objective's columns: earlier runs' stay shown
                before = json.loads(held).get("selectedColumns", [])
                state = {**state, "selectedColumns": list(dict.fromkeys([*before, *state["selectedColumns"]]))}
            key, text = VIEW_TAG_PREFIX + view, json.dumps(state, sort_keys=True)
            if held == text:
                continue
            created = now - order if held is None else json.loads(tags[key])["createdAt"]  # the menu: newest on top
            envelope = {"name": names.get(view, view), "createdAt": created, "updatedAt": now, "state": text}
            client.set_experiment_tag(experiment_id, key, json.dumps(envelope))
    except Exception as e:  # noqa: BLE001
        log.warning(f"MLflow: could not store runner's views of the runs table ({_first_line(e)})")


def _view_state(tag_value: str | None) -> str | None:
    try:
        return json.loads(tag_value)["state"] if tag_value else None
    except (ValueError, KeyError, TypeError):
        return None


# --- checks -----------------------------------------------------------------------------------


def _check_sqlite_file(path: Path, default: bool = False) -> None:
    if path.is_dir():
        raise SpecError(f"tracking.uri: {path} is a directory, not a sqlite file; name a file such as {path}/mlflow.db")
    if path.exists():
        try:
            with open(path, "r+b") as f:  # opened for writing, written nothing
                head = f.read(16)
        except OSError as e:
            raise SpecError(_store_message(path, e)) from None
        if head and head != b"SQLite format 3\x00":
            raise SpecError(f"tracking.uri: {path} is not a sqlite database; point tracking.uri at another file")
        if head:
            _check_mlflow_tables(path)
    _check_writable(path.parent, "tracking.uri", f"the MLflow store {path}",
                    "make it writable or point tracking.uri at another file")
    if not path.parent.exists() and not default:
        # Decided: only the default store's folder (outputs/) is made; a folder the user named must exist, as for
        # the sweeper's storage, so a mistyped path is refused rather than becoming a new store the runs vanish into
        raise SpecError(f"tracking.uri: the folder {path.parent} does not exist; create it (mkdir -p {path.parent}) or "
                        "point tracking.uri at a file in an existing folder")


# tables every MLflow sqlite store has, whatever its schema version
_MLFLOW_TABLES = {"experiments", "runs", "alembic_version"}


def _check_mlflow_tables(path: Path) -> None:
    """A sqlite database with tables must be an MLflow store: opening another application's file would write
    MLflow's tables into it (the migrations run on open). Read-only: nothing is written here."""
    import sqlite3

    def table_names(mode: str) -> set[str]:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode={mode}", uri=True)) as db:
            return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}

    try:
        try:
            tables = table_names("ro")
        except sqlite3.OperationalError as e:
            # a process killed mid-transaction left a hot journal: only a writable connection rolls it back, as
            # any sqlite reader of the file would; that writes no table
            if "readonly" not in str(e) or not path.with_name(path.name + "-journal").exists():
                raise
            tables = table_names("rw")
    except sqlite3.DatabaseError as e:
        raise SpecError(f"tracking.uri: {path} cannot be read as a sqlite database ({_first_line(e)}); point "
                        "tracking.uri at another file") from None
    if tables and not _MLFLOW_TABLES <= tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise SpecError(f"tracking.uri: {path} is a sqlite database of another application (its tables: {shown}), "
                        "not an MLflow store; point tracking.uri at a new file or an MLflow store")


def _check_writable(directory: Path, key: str, what: str, fix: str) -> None:
    """Write (and sync) a small probe file in the directory, or in its nearest existing parent when it
    does not exist yet: only a real write tells a full disk and a read-only mount apart from access
    bits, which root ignores."""
    target = directory.resolve()
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        with tempfile.TemporaryFile(dir=target) as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        if e.errno in _FULL:
            raise SpecError(f"{key}: disk full: cannot write {what} (no space left in {target}); free some space "
                            f"or use another disk") from None
        reason = "is read-only" if e.errno in _READ_ONLY else f"says: {e.strerror or e}"
        raise SpecError(f"{key}: cannot write {what}: {target} {reason}; {fix}") from None


def _store_message(path: Path, error: OSError) -> str:
    if error.errno in _FULL:
        return f"tracking.uri: disk full: cannot write the MLflow store {path}; free some space or use another disk"
    reason = "is read-only" if error.errno in _READ_ONLY else f"cannot be written ({error.strerror or error})"
    return f"tracking.uri: the MLflow store {path} {reason}; make it writable or point tracking.uri at another file"


def _probe_server(uri: str) -> None:
    url = uri.rstrip("/") + "/health"
    context = None
    if url.startswith("https"):
        context = ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None)
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT_S, context=context).close()
    except urllib.error.HTTPError:
        return  # something answers; MLflow reports authentication or path problems itself
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise SpecError(f"tracking.uri: no MLflow tracking server answers at {uri} ({_first_line(reason)}); "
                        f"start one with `mlflow server` or use the local default {DEFAULT_URI}") from None


def _probe_database(uri: str) -> None:
    """The driver SQLAlchemy (MLflow's database layer, as Optuna's) needs for uri is installed, and the
    database answers: one line each, the password masked (the sweeper's check, shared)."""
    from hydra_plugins.runner_optuna_sweeper.database import database_problem

    problem = database_problem(uri)
    if problem is not None:
        raise SpecError(f"tracking.uri: {problem}")


def _masked(uri: str) -> str:
    from hydra_plugins.runner_optuna_sweeper.database import masked_url

    return masked_url(uri)


def _plugin_schemes() -> set[str]:
    """Schemes that installed MLflow plugins register for tracking stores."""
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="mlflow.tracking_store")}


def _first_line(error: object) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
