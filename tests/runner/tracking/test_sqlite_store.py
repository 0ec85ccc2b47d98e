"""runner/tracking/sqlite_store.py: an existing sqlite store written without MLflow. What a run logs that way
reads back through MLflow exactly as what MLflow itself wrote: the same calls made both ways compare equal, and
a whole default run written directly logs what the same run logged through MLflow."""
from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from runner.tracking import sqlite_store
from runner.tracking.mlflow_store import open_experiment
from tests.conftest import run_cli
from tests.runner.tracking.test_store_process import REPO, _callback
from tests.runner.tracking.tracking_process_marks import MARKS, SeesMlflow

SHORT = ["trainer.max_epochs=1", "trainer.progress_bar=off"]
# differ between any two runs: who ran them, where, when, how fast, and what memory the machine had free
VOLATILE = ("runner.pid", "runner.pid_started", "run_dir", "memory.", "throughput/", "hardware.")


def _experiment(uri: str, tmp_path: Path) -> str:
    return open_experiment(MlflowClient(uri), "runner", uri, str(tmp_path / "artifacts"))


def test_the_installed_mlflow_migrates_to_a_schema_the_direct_store_writes(store: str) -> None:
    db = sqlite3.connect(store.removeprefix("sqlite:///"))
    assert {row[0] for row in db.execute("SELECT version_num FROM alembic_version")} <= sqlite_store.SCHEMAS
    assert sqlite_store.usable(store)


def test_a_store_of_another_schema_a_missing_file_or_a_new_experiment_is_left_to_mlflow(
        store: str, tmp_path: Path) -> None:
    assert sqlite_store.opened(store, "runner", str(tmp_path / "artifacts")) is None  # no such experiment yet
    _experiment(store, tmp_path)
    assert sqlite_store.opened(store, "runner", str(tmp_path / "artifacts")) is not None
    assert not sqlite_store.usable(f"sqlite:///{tmp_path}/none.db")
    db = sqlite3.connect(store.removeprefix("sqlite:///"))
    db.execute("UPDATE alembic_version SET version_num = 'f00dcafe0000'")
    db.commit()
    assert not sqlite_store.usable(store)
    assert sqlite_store.opened(store, "runner", str(tmp_path / "artifacts")) is None
    db.execute("DELETE FROM alembic_version")  # a file MLflow never migrated
    db.commit()
    assert not sqlite_store.usable(store)


def test_the_same_calls_read_back_the_same_through_mlflow_whichever_wrote_them(store: str, tmp_path: Path) -> None:
    experiment = _experiment(store, tmp_path)
    client = MlflowClient(store)
    direct = sqlite_store.opened(store, "runner", str(tmp_path / "artifacts"))
    tags = {"overrides": "optimizer=adamw", "runner.host": "h"}
    # out of order steps, a repeated value, NaN and infinities: the latest value is MLflow's pick
    metrics = [("train/loss", 0.5, 1000, 2), ("train/loss", 0.7, 900, 1), ("val/acc", math.nan, 1000, 2),
               ("big", math.inf, 5, 1), ("small", -math.inf, 5, 1), ("train/loss", 0.5, 1000, 2),
               ("lr", 0.1, 10, 3), ("lr", 0.2, 10, 3)]
    later = [("train/loss", 0.1, 800, 1), ("val/acc", 0.9, 1200, 2)]
    params = {"optimizer.lr": "0.001", "model.hidden": "[256, 128]"}
    text = "seed: 0\n"

    ours = direct.create_run(experiment, "adamw", tags)
    direct.make_call(ours, "params", {"params": params})
    direct.log_metrics(ours, metrics)
    direct.log_metrics(ours, later)
    direct.make_call(ours, "tags", {"tags": {"test_from": "best@step2", "mlflow.runName": "adamw (pruned)"}})
    direct.make_call(ours, "text", {"text": text, "file": "spec.yaml"})
    direct.make_call(ours, "record", {"tags": {"git_commit": "abc"}, "texts": {"record/run_record.json": "{}"}})
    direct.set_terminated(ours, "FINISHED")

    theirs = client.create_run(experiment, run_name="adamw", tags=tags).info.run_id
    client.log_batch(theirs, params=[Param(k, v) for k, v in params.items()])
    client.log_batch(theirs, metrics=[Metric(*m) for m in metrics])
    client.log_batch(theirs, metrics=[Metric(*m) for m in later])
    client.log_batch(theirs, tags=[RunTag("test_from", "best@step2"), RunTag("mlflow.runName", "adamw (pruned)")])
    client.log_text(theirs, text, "spec.yaml")
    client.log_batch(theirs, tags=[RunTag("git_commit", "abc")])
    client.log_text(theirs, "{}", "record/run_record.json")
    client.set_terminated(theirs, "FINISHED")

    a, b = client.get_run(ours), client.get_run(theirs)
    assert (a.info.status, a.info.run_name, a.info.user_id, a.info.lifecycle_stage) == \
        (b.info.status, b.info.run_name, b.info.user_id, b.info.lifecycle_stage)
    assert a.info.artifact_uri.replace(ours, "") == b.info.artifact_uri.replace(theirs, "")
    assert a.info.end_time >= a.info.start_time
    assert a.data.params == b.data.params and a.data.tags == b.data.tags
    assert str(sorted(a.data.metrics.items())) == str(sorted(b.data.metrics.items()))  # str: NaN equals itself
    for key in b.data.metrics:
        history = lambda run: sorted(str((m.step, m.timestamp, m.value)) for m in client.get_metric_history(run, key))
        assert history(ours) == history(theirs), key
    listed = lambda run: sorted(f.path for f in client.list_artifacts(run)) + \
        sorted(f.path for f in client.list_artifacts(run, "record"))
    assert listed(ours) == listed(theirs) == ["record", "spec.yaml", "record/run_record.json"]
    assert Path(client.download_artifacts(ours, "spec.yaml", str(tmp_path / "down"))).read_text() == text


def test_what_mlflow_refuses_the_direct_store_refuses_and_the_writer_does_not_retry(store: str, tmp_path: Path) -> None:
    experiment = _experiment(store, tmp_path)
    direct = sqlite_store.opened(store, "runner", str(tmp_path / "artifacts"))
    run = direct.create_run(experiment, "r", {})
    direct.make_call(run, "params", {"params": {"a": "1"}})
    for bad in (lambda: direct.log_metrics(run, [("bad*name", 1.0, 0, 1)]),
                lambda: direct.log_metrics(run, [("../up", 1.0, 0, 1)]),
                lambda: direct.make_call(run, "params", {"params": {"a": "2"}})):  # a param never changes
        with pytest.raises(sqlite_store.Refused) as refused:
            bad()
        assert refused.value.refused is True
    direct.set_terminated(run, "FINISHED")
    assert MlflowClient(store).get_run(run).data.params == {"a": "1"}


def test_a_default_run_written_directly_logs_what_the_same_run_logged_through_mlflow(
        tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MARKS, str(tmp_path / "marks.json"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the marks' add-on importable by the run, as a user's package
    runs = []
    for name in ("through-mlflow", "direct"):  # the first creates the experiment: MLflow's tracking process
        done = run_cli([*SHORT, _callback(SeesMlflow), f"tracking.uri={store}", f"hydra.run.dir={tmp_path / name}",
                        f"tracking.artifact_root={tmp_path / 'artifacts'}"], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append((json.loads((tmp_path / "marks.json").read_text()),
                     (tmp_path / name / "mlflow_run_id").read_text().strip()))
    assert len(runs[0][0]["children"]) == 1
    assert runs[1][0] == {"mlflow_imported": False, "children": []}  # no MLflow, no tracking process
    client = MlflowClient(store)
    (a, b) = (client.get_run(run_id) for _, run_id in runs)
    steady = lambda d: {k: v for k, v in d.items() if not k.startswith(VOLATILE)}
    assert (a.info.status, a.info.run_name) == (b.info.status, b.info.run_name)
    assert a.info.status == "FINISHED"
    assert {k: v for k, v in a.data.params.items() if k != "run_dir"} == \
        {k: v for k, v in b.data.params.items() if k != "run_dir"}
    assert set(a.data.tags) == set(b.data.tags) and steady(a.data.tags) == steady(b.data.tags)
    assert set(a.data.metrics) == set(b.data.metrics) and steady(a.data.metrics) == steady(b.data.metrics)
    for key in a.data.metrics:
        history = lambda run: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        steps = lambda run: [s for s, _ in history(run)]
        assert (steps(a) == steps(b)) if key.startswith(VOLATILE) else (history(a) == history(b)), key
    listed = lambda run: sorted(f.path for f in client.list_artifacts(run.info.run_id))
    assert listed(a) == listed(b) == ["curves.png", "record", "spec.yaml"]
