"""The objective's direction is the task's declaration for objective.metric (runner/specs/metric_names.py), unless
one is given, and then it must agree: a run keeps and tests the weights that are best the way the task says,
and everything that ranks runs reads the same resolved direction."""
from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.specs.run import SpecError
from tests.conftest import compose_spec


def test_the_direction_is_the_tasks_unless_given_and_then_it_must_agree(tmp_path: Path) -> None:
    assert compose_spec([], tmp_path).objective.direction == "maximize"  # val/acc
    assert compose_spec(["objective.metric=val/loss"], tmp_path).objective.direction == "minimize"
    assert compose_spec(["objective.metric=val/top5"], tmp_path).objective.direction == "maximize"
    assert compose_spec(["task=regression"], tmp_path).objective.direction == "minimize"  # its val/loss
    assert compose_spec(["objective.metric=val/loss", "objective.direction=minimize"], tmp_path).objective.direction \
        == "minimize"
    with pytest.raises(SpecError) as err:
        compose_spec(["objective.metric=val/loss", "objective.direction=maximize"], tmp_path)
    assert str(err.value) == ("objective.direction: maximize contradicts the task: Classification declares val/loss "
                              "minimize; allowed: minimize, or null (the task's)")


def test_a_typed_direction_that_contradicts_the_task_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture) -> None:
    # through the CLI's entry in this process (an interpreter start saved, CI budget; tests/runner/test_bad_input.py)
    from tests.runner.test_bad_input import RUN, run_in_process

    code, _, err = run_in_process(["objective.metric=val/loss", "objective.direction=maximize", "trainer.max_steps=2"],
                                  tmp_path, RUN, monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "error: objective.direction: maximize contradicts the task: Classification declares val/loss minimize; "
        "allowed: minimize, or null (the task's)"]
    assert not (tmp_path / "outputs" / "runs").exists()  # refused before anything was made


def test_a_val_loss_objective_keeps_and_tests_its_lowest_weights(tmp_path: Path, store: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """60 steps on digits, validated every 10: val/loss falls, so its best is its lowest, and the test runs on
    the weights of that step (not on the step-10 weights, the highest val/loss, as when it was maximised).
    Run as the CLI's launch runs it, in this process (a process start saved: the command line's own part,
    a refused direction, is the test above)."""
    from runner.cli import launch

    uri = store
    caplog.set_level("INFO", logger="runner.cli.launch")  # the summary the console shows
    launch.run(compose_spec(["objective.metric=val/loss", "trainer.max_steps=60", "trainer.eval_every_n_steps=10",
                             "trainer.eval_every_epoch=false", "trainer.progress_bar=off"], tmp_path / "run", uri))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/loss")}
    assert sorted(history) == [10, 20, 30, 40, 50, 60]
    lowest = min(history, key=history.get)
    assert max(history, key=history.get) != lowest  # the run tells the two directions apart
    assert run.data.metrics["best_val_loss"] == history[lowest]
    assert run.data.metrics["objective"] == history[lowest]
    assert run.data.tags["test_from"] == f"best@step {lowest}"
    assert run.data.params["objective.direction"] == "minimize"  # what compare ranks by
    assert f"best val/loss: {history[lowest]:.4f} (step {lowest})" in caplog.text
