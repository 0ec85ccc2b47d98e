"""runner/tracking/store_process.py: a run's MLflow store opened and called in the tracking process. What the
run logs reads back whole and exact from a real store, a refusal still comes before training, and a tracking
process that dies loses nothing."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.specs.run import RunSpec
from runner.tracking import journal
from runner.tracking.tracker import params_of
from tests.conftest import run_cli
from tests.runner.tracking.tracking_process_marks import MARKS, KillsTrackingProcess, SeesMlflow

SHORT = ["trainer.max_epochs=2", "trainer.progress_bar=off"]
REPO = Path(__file__).resolve().parents[3]


def _callback(cls: type) -> str:
    return f"trainer.callbacks=[{{_target_:{cls.__module__}.{cls.__name__}}}]"


def _cli(args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(MARKS, str(tmp_path / "marks.json"))
    # the marks' module (tests/...) importable by the run, as a user's own package would be (an install does not
    # make the checkout's tests/ importable from another directory)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return run_cli([f"tracking.uri={_uri(tmp_path)}", f"tracking.artifact_root={tmp_path / 'artifacts'}",
                    f"hydra.run.dir={tmp_path / 'run'}", *args], tmp_path)


def _uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"


def _journal_values(run_dir: Path, run_id: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for step, _, values in journal.read(run_dir / journal.FILE, run_id):
        for key, value in values.items():
            out.setdefault(key, {})[step] = value
    return out


def _store_values(client: MlflowClient, run_id: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        history = client.get_metric_history(run_id, key)
        out[key] = {m.step: m.value for m in history}
        assert len(history) == len(out[key]), f"{key}: a step logged twice"
    return out


def test_a_run_logs_through_the_tracking_process_and_its_metrics_params_and_tags_read_back_whole(
        tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    done = _cli([*SHORT, _callback(SeesMlflow)], tmp_path, monkeypatch)
    assert done.returncode == 0, done.stderr[-2000:]
    marks = json.loads((tmp_path / "marks.json").read_text())
    assert marks["mlflow_imported"] is False  # the training process never imported MLflow
    assert len(marks["children"]) == 1
    run_dir = tmp_path / "run"
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    client = MlflowClient(_uri(tmp_path))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    logged = _journal_values(run_dir, run_id)
    assert {"train/loss", "val/acc", "test/acc", "objective"} <= set(logged)
    assert _store_values(client, run_id) == logged  # every value, every step, exactly (floats compared equal)
    spec = RunSpec.from_yaml((run_dir / "spec.yaml").read_text())
    assert run.data.params == params_of(spec)
    assert run.data.tags["overrides"] == " ".join(spec.overrides)
    assert run.data.tags["runner.pid"] != str(marks["children"][0])  # the training process keeps the run
    assert run.data.tags["test_from"].startswith("best@step")
    stored = client.download_artifacts(run_id, "spec.yaml", str(tmp_path / "down"))
    assert Path(stored).read_text() == (run_dir / "spec.yaml").read_text()
    assert {a.path for a in client.list_artifacts(run_id)} >= {"spec.yaml", "curves.png", "record"}
    assert not journal.calls(run_dir / journal.FILE, run_id)  # the store confirmed every call


def test_a_store_refusal_from_the_tracking_process_comes_before_training_and_leaves_no_run(
        tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = MlflowClient(_uri(tmp_path))
    client.delete_experiment(client.create_experiment("gone", artifact_location=(tmp_path / "a").as_uri()))
    done = _cli([*SHORT, "tracking.experiment=gone"], tmp_path, monkeypatch)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: tracking.experiment: MLflow experiment 'gone' is "
                                                           "deleted")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / journal.FILE).exists()  # no step trained, no run started
    experiments = [e.experiment_id for e in client.search_experiments(view_type=3)]
    assert client.search_runs(experiments, run_view_type=3) == []


@pytest.mark.slow  # two runs through the CLI (about 25 s on a quiet machine)
def test_a_killed_tracking_process_is_one_line_training_finishes_and_the_resume_completes_the_run(
        tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    done = _cli([*SHORT, _callback(KillsTrackingProcess)], tmp_path, monkeypatch)
    assert done.returncode == 0, done.stderr[-2000:]
    killed = json.loads((tmp_path / "marks.json").read_text())["killed"]
    assert len(killed) == 1
    said = [line for line in (done.stdout + done.stderr).splitlines() if f"pid {killed[0]}" in line]
    assert len(said) == 1 and "killed by signal 9" in said[0] and "training goes on" in said[0]
    assert "trained 40 optimizer steps" in done.stdout + done.stderr
    run_dir = tmp_path / "run"
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert journal.ended(run_dir / journal.FILE, run_id) == "FINISHED"
    client = MlflowClient(_uri(tmp_path))
    assert client.get_run(run_id).info.status == "RUNNING"  # its end never reached the store
    # the resume's opening completes the run from the journal, then the run goes on to epoch 3 in it
    resumed = run_cli([f"trainer.resume={run_dir}", "trainer.max_epochs=3"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"({run_id}) ended FINISHED while this store could not be reached: completed now" in resumed.stdout
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    logged = _journal_values(run_dir, run_id)
    assert sorted(logged["train/loss"]) == [10, 20, 30, 40, 50, 60]
    assert _store_values(client, run_id) == logged  # each value once, exactly as the journal holds it
    assert run.data.tags["test_from"].startswith("best@step")  # calls made after the death, from the journal
    assert "curves.png" in {a.path for a in client.list_artifacts(run_id)}
