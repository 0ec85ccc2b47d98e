"""runner/store_opening.py: the MLflow store opened on a thread while the engine builds, with the same
run and the same one-line errors as a store opened when training starts."""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner import store_opening
from runner.spec import SpecError
from runner.tracking import build_tracker, params_of
from tests.runner.test_bad_input import RUN, run_in_process
from tests.runner.test_tracking import read_only_dir, spec_at  # noqa: F401  (read_only_dir: a fixture)


@pytest.fixture
def opened_by(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that open a store for a tracker, in order."""
    names, real_open = [], store_opening._open

    def open_and_say_where(*key):
        names.append(threading.current_thread().name)
        return real_open(*key)

    monkeypatch.setattr(store_opening, "_open", open_and_say_where)
    return names


def test_the_run_logs_to_the_store_the_thread_opened(tmp_path: Path, store: str, opened_by: list[str]) -> None:
    spec = spec_at(tmp_path)
    store_opening.open_in_background(spec.tracking)
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.log_metrics({"loss": 0.5}, 1)
    tracker.finish("FINISHED")
    assert opened_by == ["runner-mlflow-open"]  # opened once, on the thread, and taken by the tracker
    run = MlflowClient(spec.tracking.uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.experiment_id == tracker.experiment_id
    assert MlflowClient(spec.tracking.uri).get_experiment(run.info.experiment_id).name == "runner"
    assert run.data.params == params_of(spec) and run.data.metrics == {"loss": 0.5}


def test_an_error_on_the_thread_reaches_the_tracker_as_its_one_line_and_no_run_is_made(
        tmp_path: Path, read_only_dir: Path, store: str) -> None:  # noqa: F811
    spec = spec_at(tmp_path)
    client = MlflowClient(spec.tracking.uri)
    experiment = client.create_experiment("runner", artifact_location=read_only_dir.as_uri())
    store_opening.open_in_background(spec.tracking)
    with pytest.raises(SpecError) as error:
        build_tracker(spec).start(spec)
    assert str(error.value).startswith("tracking.artifact_root: ") and "read-only" in str(error.value)
    assert "\n" not in str(error.value)
    assert client.search_runs([experiment]) == []


def test_a_store_that_fails_to_open_on_the_thread_is_one_line_from_the_cli(
        tmp_path: Path, opened_by: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A sqlite file of a schema MLflow does not know passes the checks made before the run (it is a writable
    sqlite file) and fails only when MLflow opens it: on the thread, while the engine builds."""
    db = tmp_path / "foreign.db"
    with sqlite3.connect(db) as connection:
        connection.execute("create table alembic_version (version_num varchar(32) not null)")
        connection.execute("insert into alembic_version values ('deadbeef')")
    code, out, err = run_in_process([f"tracking.uri=sqlite:///{db}", "trainer.max_steps=2"], tmp_path, RUN,
                                    monkeypatch, capsys)
    assert code == 2 and "Traceback" not in out + err
    assert err.strip() == (f"error: tracking.uri: cannot open the MLflow store sqlite:///{db} (Can't locate revision "
                           f"identified by 'deadbeef'); fix or move it, or use another tracking.uri")
    assert opened_by == ["runner-mlflow-open"] and store_opening._openings == {}  # taken, not left to a next job
