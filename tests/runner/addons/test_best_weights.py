"""trainer.test_on=best|last (runner/addons/best_weights.py) and trainer.resume=latest (runner/cli/run_dir.py)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from runner.engine import checkpoint
from runner.engine.engine import Engine
from runner.cli.run_dir import latest_run
from runner.specs.run import SpecError
from tests.conftest import compose_spec
from tests.runner.addons.test_averaging import assert_close_weights, recording
from runner.tracking.tracker import NullTracker
from tests.runner.engine.test_engine import ctrl_c_during_step

# val/acc minimized: the best validation is an early one (accuracy rises), never the last step's
BEST = ["model.hidden=[16]", "dataset.batch_size=256", "trainer.progress_bar=off", "trainer.eval_every_epoch=false",
        "trainer.max_steps=6", "trainer.eval_every_n_steps=2", "trainer.checkpoint_every_n_steps=2",
        "trainer.keep_checkpoints=1", "task._target_=tests.user_pkg.training.LowAccuracyFirst", "model.dropout=0.2",
        "trainer.memory_estimate=false"]


class RecordingTracker(NullTracker):
    """What the engine hands MLflow's tracker (Tracker.log_metrics, set_tags); an MLflow store costs seconds to make."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[tuple[int, float]]] = {}
        self.tags: dict[str, str] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.metrics.setdefault(name, []).append((step, value))

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def hand_test(engine: Engine, weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """test/loss and test/acc of `weights`, computed here without the engine's evaluation."""
    module = engine.module
    kept = {k: v.clone() for k, v in module.state_dict().items()}
    module.load_state_dict(weights)
    module.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for inputs, labels in engine.eval_loaders["test"]:
            logits = module(inputs)
            loss += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(-1) == labels).sum().item()
            count += len(labels)
    module.load_state_dict(kept)
    return {"test/loss": loss / count, "test/acc": correct / count}


def test_a_run_tests_on_its_best_weights_kept_through_rotation_a_kill_and_its_resume(tmp_path: Path) -> None:
    """Best at step 2, checkpoints at 2 and 4 (keep_checkpoints=1), Ctrl-C in step 5, resumed from step 4: the
    test metrics logged are those of step 2's weights, evaluated here by hand, not those of the last weights."""
    run = tmp_path / "run"
    cut = ctrl_c_during_step(Engine(compose_spec(BEST, run)), 5)
    before_kill = recording(cut)  # the weights after each step: [0] before the first
    with pytest.raises(KeyboardInterrupt):
        cut.fit()
    tracker = RecordingTracker()
    resumed = Engine(compose_spec([*BEST, f"trainer.resume={run}"], run), tracker)
    assert resumed.progress.step == 4
    after_resume = recording(resumed)  # [0]: step 4's, then steps 5 and 6
    result = resumed.fit()
    best = result.best_step["val/acc"]
    assert best == 2 and result.steps == 6
    files = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert files == ["best-step-00000002.pt", "last.pt", "step-00000006.pt"]  # rotation kept it
    saved = checkpoint.load(run / "checkpoints" / "best-step-00000002.pt")  # a runner checkpoint
    assert_close_weights(saved["model"], before_kill[2])

    by_hand = hand_test(resumed, before_kill[2])
    for name in ("test/loss", "test/acc"):
        assert tracker.metrics[name] == [(6, pytest.approx(by_hand[name], rel=1e-6))]
    assert hand_test(resumed, after_resume[-1])["test/loss"] != pytest.approx(by_hand["test/loss"], rel=1e-3)
    assert tracker.tags["test_from"] == result.test_from == "best@step 2"
    # the final checkpoint and the model still hold the last weights: a resume extending the run goes on exactly
    assert_close_weights(checkpoint.load(run / "checkpoints" / "last.pt")["model"], after_resume[-1])
    assert_close_weights(resumed.module.state_dict(), after_resume[-1])


@pytest.mark.parametrize("overrides, said", [
    (["trainer.test_on=last"], False),
    (["trainer.save_checkpoints=false"], True),  # debug=fast: nothing written, so no best weights kept either
])
def test_test_on_last_or_no_checkpoints_tests_the_last_weights_and_keeps_no_best_file(
        tmp_path: Path, caplog, overrides: list[str], said: bool) -> None:
    caplog.set_level(logging.INFO)
    engine = Engine(compose_spec([*BEST, *overrides], tmp_path / "run"))
    seen = recording(engine)
    result = engine.fit()
    by_hand = hand_test(engine, seen[-1])
    assert {k: result.final[k] for k in by_hand} == pytest.approx(by_hand, rel=1e-6)
    assert result.test_from == "last@step 6"
    assert not list((tmp_path / "run").glob("checkpoints/best-*"))
    assert ("trainer.save_checkpoints=false keeps no weights of step 2; testing the last weights (step 6)"
            in caplog.text) == said


def test_no_validation_of_the_objective_tests_the_last_weights_and_says_so(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    result = Engine(compose_spec(["model.hidden=[16]", "trainer.progress_bar=off", "trainer.max_steps=1",
                                  "dataset.val_fraction=0", "objective.metric=test/acc"], tmp_path / "run")).fit()
    assert result.test_from == "last@step 1" and "test/acc" in result.final
    assert "trainer.test_on=best: test/acc was never evaluated" in caplog.text


def test_resume_latest_picks_the_run_written_to_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match="^trainer.resume: latest finds no training run under "):
        latest_run()
    runs = tmp_path / "outputs" / "runs" / "2026-11-23"
    for name, when in (("older", 1000), ("newer", 2000), ("fresh", 3000)):
        (runs / name / "checkpoints").mkdir(parents=True)
        (runs / name / "spec.yaml").write_text("{}")
        os.utime(runs / name / "spec.yaml", (when, when))
    (runs / "older" / "checkpoints" / "last.pt").write_bytes(b"")  # written after both spec.yaml files
    os.utime(runs / "older" / "checkpoints" / "last.pt", (2500, 2500))
    (runs / "hydra_only" / ".hydra").mkdir(parents=True)  # this command's own new directory: no run
    (runs / "fresh" / "spec.yaml").unlink()
    assert latest_run() == runs / "older"
    # a mode=predict (eval, export) run written after it is no training run to continue
    (runs / "predicted").mkdir()
    (runs / "predicted" / "spec.yaml").write_text("mode: predict\n")
    os.utime(runs / "predicted" / "spec.yaml", (4000, 4000))
    assert latest_run() == runs / "older"
    (runs / "predicted" / "spec.yaml").write_text("mode: train\n")
    os.utime(runs / "predicted" / "spec.yaml", (4000, 4000))
    assert latest_run() == runs / "predicted"


@pytest.mark.slow  # an MLflow store costs seconds to make; in CI the fast test above checks what the tracker is handed
def test_mlflow_holds_the_best_weights_test_metrics_and_their_step(tmp_path: Path, sqlite_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    from tests.runner.engine.test_engine import tracked

    engine = tracked(BEST, tmp_path / "run", sqlite_uri)
    seen = recording(engine)
    result = engine.fit()
    run = MlflowClient(sqlite_uri).get_run(engine.tracker.run_id)
    by_hand = hand_test(engine, seen[result.best_step["val/acc"]])
    assert {k: run.data.metrics[k] for k in by_hand} == pytest.approx(by_hand, rel=1e-6)
    assert run.data.tags["test_from"] == f"best@step {result.best_step['val/acc']}" and result.best_step["val/acc"] < 6
