"""Tracking: every run lands in MLflow (rank 0 only), or nowhere with tracking=none.

MlflowClient is used rather than the fluent `mlflow.start_run` API: no process-global active run,
so parallel trials in one process and resumed runs each address their own run id.
Tracking never makes training wait: opening the store may start in the background (`open_now`), and
once the run exists every store call (metrics, params, tags, artifacts, the run's end) is made by one
background thread in the order it was logged (runner/tracking/writer.py); a slow or unreachable store
delays what MLflow shows, never a step. Each metric is also written to the run directory's journal
(runner/tracking/journal.py), which `flush` writes out (the engine calls it before writing a checkpoint),
so a kill loses nothing a resume does not log again: a resumed run logs from the journal what its
MLflow run lacks and skips the (metric, step) pairs the run holds, so its history has every step once.
`finish` waits for the writer (while the store makes progress) before it sets the run's end.
Store checks and the store lock live in runner.tracking.mlflow_store.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from runner.specs import metric_names

from runner.tracking import calls, journal, sqlite_store, store_process
from runner.tracking.store import Store
from runner.tracking.journal import Journal
from runner.tracking.writer import StoreWriter, first_line, refused
from runner.tracking.mlflow_store import (DEFAULT_URI, check_tracking, experiment_page, open_client, open_experiment, owner_tags,
                                  saved_views)
from runner.specs.run import RunSpec, SpecError

log = logging.getLogger(__name__)

RUN_FILE = "mlflow_run_id"
_FLUSH_EVERY_S = 2.0  # the writer sends what was logged this often, and at every flush
_PATIENCE_S = 30.0    # flush and finish wait this long for a store that stores nothing, then leave it to the writer
PATIENCE_ENV = "RUNNER_TRACKING_PATIENCE_S"  # that wait in seconds, where set (a test of an outage: a second or two)

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
    def flush(self, wait: bool = True) -> bool: ...
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
    def flush(self, wait: bool = True) -> bool:
        return True

    def finish(self, status: str) -> None: ...

    def describe(self) -> str:
        return "tracking is off (tracking=none)"


OPENING_THREAD = "runner-mlflow-open"
# What opening a store says below WARNING: its migrations, and its SQL statements where the job's log levels
# were restored (runner/cli/process_state.py) before the opening ended (a run refused while its store opened)
_OPENING_CHATTER = ("sqlalchemy.engine.Engine", "alembic.runtime.migration", "alembic.runtime.plugins",
                    "mlflow.store.db.utils")


def _quiet_opening(record: logging.LogRecord) -> bool:
    return record.threadName != OPENING_THREAD or record.levelno >= logging.WARNING


class _Opening:
    """`import mlflow`, the store opened (a fresh sqlite file created and migrated) and the experiment found or
    created: seconds of start-up. `how`: "process", in the tracking process (runner/tracking/store_process.py),
    on another core while this process imports torch and builds the run; "thread", in a thread of this
    process (a multirun's jobs share one process, and one MLflow import); "now", when `result` is asked.
    Its refusals (a store MLflow cannot open, a deleted experiment, an artifact location turned read-only)
    are raised by `result`, before the run exists. The thread is no daemon: a process that exits early still
    finishes a migration it began."""

    def __init__(self, uri: str, experiment: str, artifact_root: str, how: str):
        self.uri, self.experiment, self.artifact_root = uri, experiment, artifact_root
        self._outcome: tuple[Any, str] | BaseException | None = None
        # an existing sqlite store is written without MLflow (runner/tracking/sqlite_store.py): opened now, in ms
        direct = None if how == "process" and store_process.pending() else sqlite_store.opened(uri, experiment,
                                                                                              artifact_root)
        if direct is not None:
            self._outcome, how = (direct, direct.experiment_id), "opened"
        self._process = store_process.started(uri, experiment, artifact_root) if how == "process" else None
        self._thread = threading.Thread(target=self._open, name=OPENING_THREAD) if how == "thread" else None
        if self._thread is not None:
            for name in _OPENING_CHATTER:
                logging.getLogger(name).addFilter(_quiet_opening)
            self._thread.start()

    def _open(self) -> None:
        # The console's handlers drop this thread's records below WARNING while it opens: MLflow's migrations
        # reconfigure SQLAlchemy's and alembic's loggers, and a run refused meanwhile printed up to 2,000
        # lines of their set-up under runner's INFO root (filters on the named loggers above do not reach
        # records their children propagate).
        handlers = list(logging.root.handlers) if self._thread is not None else []
        for handler in handlers:
            handler.addFilter(_quiet_opening)
        try:
            opened = Store()
            self._outcome = (opened, opened.open(self.uri, self.experiment, self.artifact_root))
        except BaseException as e:  # noqa: BLE001  (raised by result(), in the thread that starts the run)
            self._outcome = e
        finally:
            for handler in handlers:
                handler.removeFilter(_quiet_opening)

    def result(self) -> tuple[Any, str]:
        """(the store's calls: runner/tracking/store.py's, here or in the tracking process; experiment id)."""
        if self._process is not None and self._outcome is None:
            try:
                self._outcome = (self._process, self._process.opened())
            except store_process.StoreGone as e:  # opened here instead: the run goes on as it would have
                log.warning("MLflow: %s before it opened the store; opening it in this process", e)
                self._process = None
        if self._thread is not None:
            self._thread.join()
        elif self._outcome is None:
            self._open()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome


class MlflowTracker:
    """`open_now`: start opening the store at once, "process" in the tracking process or "thread" in a thread
    of this one (runner/cli/launch.py does, before the engine builds its data and model); otherwise
    `start` opens it."""

    def __init__(self, uri: str, experiment: str, artifact_root: str, parent_run_id: str | None = None,
                 run_file: Path | None = None, open_now: bool | str = False):
        self.uri = uri
        self.store: Any = None  # runner/tracking/store.py's calls, opened in start, after the store is checked
        self.experiment = experiment
        self.artifact_root = artifact_root
        self.parent_run_id = parent_run_id
        self.run_file = run_file  # the run directory remembers its MLflow run: restarts reattach to it
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.run_name = ""
        how = open_now if isinstance(open_now, str) else "thread" if open_now else "now"
        self._opening = _Opening(uri, experiment, artifact_root, how)
        self._writer: StoreWriter | None = None
        self._journal: Journal | None = None
        self._logged: dict[str, set[int]] = {}  # steps the run already held when this tracker reattached
        self._here: Store | None = None  # the store opened in this process too, where `client` was asked for

    @property
    def client(self) -> Any:
        """An MlflowClient on the run's store (for callers that read the run back: k-fold's results); opened in
        this process where the store's calls are made in the tracking process. None before the run starts."""
        if self.store is None:
            return None
        return self._store_here().client

    def _store_here(self) -> Store:
        """The store opened in this process (where its calls are made in the tracking process: now)."""
        if isinstance(self.store, Store):
            return self.store
        if self._here is None:
            self._here = Store()
            self._here.open(self.uri, self.experiment, self.artifact_root)
        return self._here

    def _check_parent(self, spec: RunSpec) -> None:
        """The parent run must be a live run of this store: MLflow would tag a child with any id, and the run
        would hang under nothing (or under a deleted run) in the UI."""
        parent = self.store.run(self.parent_run_id)
        if parent is None or parent["stage"] == "deleted":
            what = "is no MLflow run" if parent is None else "is a deleted MLflow run"
            raise SpecError(f"{_parent_key(spec)}: {self.parent_run_id} {what} in {self.uri}; runner sets it for a "
                            "k-fold run's folds (leave trainer.cross_validation.parent_run unset)")

    def start(self, spec: RunSpec, resume_run_id: str | None = None) -> None:
        """Creates the run (or reattaches to it) and returns: its params, spec.yaml and run record are stored
        by the writer while the run trains."""
        self.store, self.experiment_id = self._opening.result()
        maximize = spec.objective.direction == "maximize"
        views = saved_views(main_metrics(spec), maximize, spec.objective.metric)
        if not resume_run_id and self.run_file is not None and self.run_file.exists():
            resume_run_id = self.run_file.read_text().strip()
        if resume_run_id and self.store.run(resume_run_id) is not None:
            self._logged = {key: set(steps) for key, steps in self.store.logged_steps(resume_run_id).items()}
            self.run_id = resume_run_id
            # this process keeps it RUNNING now; an earlier ending is history
            self.run_name = self.store.reattach(resume_run_id, owner_tags())
            self._open_writer()
            self._replay_journal()
            self._send("views", {"experiment_id": self.experiment_id, "views": views}, "the runs table's views")
            return
        self.run_name = spec.tracking.run_name or run_name_from(spec.overrides)
        tags = {"overrides": " ".join(spec.overrides) or "(none)",
                "host": socket.gethostname(), "run_dir": spec.run_dir, **owner_tags()}
        if self.parent_run_id:
            self._check_parent(spec)
            tags["mlflow.parentRunId"] = self.parent_run_id
        self.run_id = self.store.create_run(self.experiment_id, self.run_name, tags)
        try:  # from here on a failure must not leave the run RUNNING
            if self.run_file is not None:
                self.run_file.parent.mkdir(parents=True, exist_ok=True)
                self.run_file.write_text(self.run_id)
            self._open_writer()
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM/SIGHUP, a sweep's death: killed, as anywhere later in the run
            self.store.set_terminated(self.run_id, "KILLED")
            raise
        except BaseException:
            self.store.set_terminated(self.run_id, "FAILED")
            raise
        self._send("params", {"params": params_of(spec)}, "params")
        self._send("text", {"text": spec.to_yaml(), "file": "spec.yaml"}, "spec.yaml")
        self._send_record(spec)  # commit, diff, packages, hardware, data: to reproduce it
        self._send("views", {"experiment_id": self.experiment_id, "views": views}, "the runs table's views")

    def _send(self, kind: str, args: dict, what: str, op: str | None = None) -> None:
        """A store call (runner/tracking/calls.py) through the writer, in order, and in the journal until the
        store confirms it; after the run ended (a caller adding to a finished run), now. A text the store
        refuses is said, not raised: it may be the traceback of a run that is failing."""
        run_id = self.run_id

        def make(store: Any) -> None:
            try:
                args.update(store.make_call(run_id, kind, args))  # what the call added: a retry goes on from there
            except Exception as e:
                if kind != "text" or not refused(e):
                    raise  # the store did not answer: the writer retries; a refusal is the tracker's to raise
                log.warning("MLflow: could not store %s: %s", args["file"], first_line(e))

        if self._writer is None:
            if run_id is not None:
                make(self._ended_store())
            return
        held = self._journal
        if held is not None:
            op = held.call(kind, args, op)
        self._writer.call(make, what, None if held is None else lambda: held.stored(op))

    def _send_record(self, spec: RunSpec) -> None:
        """The run record, built on the writer's thread (git calls, packages: seconds), and written to the
        journal once built, so that a store that cannot take it gets what this run recorded."""
        run_id, held, args = self.run_id, self._journal, {}
        op = held.call("record", args) if held is not None else None

        def store(store: Any) -> None:
            if "tags" not in args:
                args.update(calls.record_args(spec))
                if held is not None:
                    held.call("record", args, op)
            store.make_call(run_id, "record", args)

        self._writer.call(store, "the run record", None if held is None else lambda: held.stored(op))

    def _open_writer(self) -> None:
        where = str(self.run_file.parent / journal.FILE) if self.run_file is not None else "no local file"
        self._writer = StoreWriter(self.store, self.run_id, self.uri, where, _FLUSH_EVERY_S, _patience())
        if self.run_file is not None:
            self._journal = Journal(self.run_file.parent / journal.FILE, self.run_id)

    def _replay_journal(self) -> None:
        """A reattached run: what the run directory's journal holds and the MLflow run lacks (queued when the
        process was killed) is logged now, and training skips those steps as it skips the stored ones."""
        if self._journal is None:
            return
        replayed = 0
        for step, ms, values in journal.read(self._journal.path, self.run_id) or []:
            missing = {k: v for k, v in values.items() if step not in self._logged.get(k, ())}
            if missing:
                self._writer.metrics(step, ms, missing)
                replayed += len(missing)
        for step, _, values in journal.read(self._journal.path, self.run_id) or []:
            for key in values:
                self._logged.setdefault(key, set()).add(step)
        unconfirmed = journal.calls(self._journal.path, self.run_id)
        for op, kind, args in unconfirmed:
            self._send(kind, args, f"{kind} (from {self._journal.path})", op)
        if replayed or unconfirmed:
            log.info("MLflow: %d metric values and %d other calls the run lacked logged from %s", replayed,
                     len(unconfirmed), self._journal.path)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items()}  # a copy, of plain floats (the journal writes JSON)
        if self._logged:  # a reattached run: what it holds already is not logged twice
            values = {k: v for k, v in values.items() if step not in self._logged.get(k, ())}
            if not values:
                return
        ms = int(time.time() * 1000)
        if self._writer is None:  # the run ended: a caller adding to it stores at once
            self._ended_store().log_metrics(self.run_id, [(k, v, ms, step) for k, v in values.items()])
            return
        if self._journal is not None:
            self._journal.add(step, ms, values)
        self._writer.metrics(step, ms, values)

    def log_summary(self, objective: float, best: dict[str, float], step: int) -> None:
        """The runs table shows a metric's last value; these columns rank runs by their best."""
        self.log_metrics({"objective": objective, **{best_key(k): v for k, v in best.items()}}, step)

    def log_artifact(self, path: Path) -> None:
        self._send("artifact", {"path": str(Path(path).resolve()), "artifact_path": None}, f"the artifact {Path(path).name}")

    def log_text(self, text: str, artifact_file: str) -> None:
        """Called while a run fails (its traceback): a store refusing it must not hide that failure."""
        if self.run_id is not None:
            self._send("text", {"text": text, "file": artifact_file}, artifact_file)

    def log_saved_model(self, directory: Path, name: str, step: int, tags: dict[str, str], source: str) -> None:
        """A model saved by mlflow.pytorch.save_model in `directory` while the store could not be reached:
        logged as the run's model named `name` (at `step`) once it answers (runner/tracking/calls.py)."""
        self._send("model", {"dir": str(Path(directory).resolve()), "name": name, "step": step, "tags": tags,
                             "source": source}, f"the MLflow model '{name}'")

    def set_tags(self, tags: dict[str, str]) -> None:
        self._send("tags", {"tags": {k: str(v) for k, v in tags.items()}}, "tags")

    @property
    def unreachable(self) -> bool:
        """The store has not answered lately (an outage said and not over)."""
        return self._writer is not None and self._writer.unreachable

    def flush(self, wait: bool = True) -> bool:
        """Every metric logged so far to the run directory's journal (for good: a kill after this loses none
        of them), and to the store now. `wait`: until the store holds them too, while it makes progress
        (a store that makes none for _PATIENCE_S seconds is left to the writer: training goes on).
        A value the store refused is raised here. Returns whether the store holds everything now (False
        without `wait`)."""
        if self._writer is None:
            return True
        if self._journal is not None:
            self._journal.write_out()
        stored = False
        if wait:
            stored = self._writer.wait()
        else:
            self._writer.send_now()
        self._raise_refusal()
        return stored

    def _raise_refusal(self) -> None:
        if self._writer.refusals:
            error, self._writer.refusals[:] = self._writer.refusals[0], []
            raise error

    def finish(self, status: str) -> None:
        """End the run once everything logged is stored. A value the store refused ends it FAILED (and a
        FINISHED run raises); a store that stays unreachable is said once, and the run goes on ending."""
        if self._writer is None:
            return
        writer = self._writer
        if self._journal is not None:
            self._journal.write_out()
        stored = writer.wait()
        refusals, writer.refusals[:] = list(writer.refusals), []
        if refusals:
            log.warning("MLflow: could not store the last metrics of run %s: %s", self.run_id, first_line(refusals[0]))
        run_id, ending = self.run_id, "FAILED" if refusals else status
        if self._journal is not None:
            self._journal.close(ending)  # a store that stays unreachable gets the run's end from here later
        writer.call(lambda store: store.set_terminated(run_id, ending), "the run's end")
        ended = stored and writer.wait()
        writer.close()
        self._writer = None
        if isinstance(self.store, store_process.StoreProcess):  # waited for: its CPU is the run's
            if ended:  # else the writer's thread still tries the store: it is closed as this process exits
                self.store.close()
        elif isinstance(self.store, sqlite_store.SqliteStore) and ended:
            self.store.close()
        if not ended:
            writer.end_said = True  # the writer, still trying, says nothing more of it
            waiting, first, whats = writer.left()
            values = f"{waiting} metric values (from step {first}), " if waiting else ""
            others = "".join(f"{what}, " for what in dict.fromkeys(whats) if what != "the run's end")
            log.warning("MLflow at %s is still %s at the end of the run: %s%sthe run's end (%s) are not "
                        "stored; %s holds them (and the files they name), and `trainer.resume` of this run or the next "
                        "runner command on this store (on this host) completes the MLflow run from it", self.uri,
                        writer.state, values, others, ending, writer.journal)
        if refusals and status == "FINISHED":
            raise refusals[0]  # a run whose metrics are lost did not finish; an ending failure keeps its own error

    def _ended_store(self) -> Any:
        """The store's calls for a caller adding to the run after its end: in this process by then."""
        if isinstance(self.store, store_process.StoreProcess) and self.store.usable:
            return self.store
        if isinstance(self.store, sqlite_store.SqliteStore) and not self.store.closed:
            return self.store
        return self._store_here()

    def describe(self) -> str:
        run = f"MLflow run '{self.run_name}' ({self.run_id}) in experiment '{self.experiment}'"
        if self.parent_run_id:  # a fold, a sweep's job, a PBT member: their parent run says how to see them, once
            return run
        if self.uri.startswith("http"):
            where = experiment_page(self.uri, self.experiment_id or "0")
        else:  # the link opens the runs table, not MLflow 3's GenAI overview
            ui = "make ui" if self.uri == DEFAULT_URI else f"python -m runner.tracking.mlflow_ui --backend-store-uri {self.uri}"
            where = f"{ui}, then {experiment_page('http://127.0.0.1:5000', self.experiment_id or '0')}"
        return f"{run}; see it with: {where}"


def _patience() -> float:
    try:
        return float(os.environ[PATIENCE_ENV])
    except (KeyError, ValueError):
        return _PATIENCE_S


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


# the store's answers that mean "there is no such run"; anything else (a sqlite store locked past its 20 s busy
# timeout under load, a server briefly down) says nothing about the run
_NO_SUCH_RUN = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def run_exists(client: Any, run_id: str, attempts: int = 5) -> bool:
    """Whether the store holds run_id. Only the store's "no such run" is False: a sweep that read a busy store
    as "gone" opened a second parent run for one study. A store that stays busy is asked again, then raises."""
    attempt = 1
    while True:
        try:
            client.get_run(run_id)
            return True
        except Exception as e:
            if getattr(e, "error_code", None) in _NO_SUCH_RUN:
                return False
            if attempt == attempts:
                raise
            log.debug("the store did not say whether run %s exists (%s); asking again", run_id, first_line(e))
            time.sleep(min(2.0 ** attempt, 10.0))
            attempt += 1


def _parent_key(spec: RunSpec) -> str:
    return ("trainer.cross_validation.parent_run" if spec.trainer.cross_validation.parent_run
            else "the sweep's MLflow parent run")


def build_tracker(spec: RunSpec, rank: int = 0, parent_run_id: str | None = None, open_now: bool | str = False) -> Tracker:
    """`open_now`: the store starts opening in the background at once: True in a thread, "process" in the
    tracking process (see MlflowTracker)."""
    if spec.tracking.name == "none" or rank != 0:
        return NullTracker()
    t = spec.tracking
    return MlflowTracker(t.uri, t.experiment, t.artifact_root, parent_run_id, Path(spec.run_dir) / RUN_FILE, open_now)


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
