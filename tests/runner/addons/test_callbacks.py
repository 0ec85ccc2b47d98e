"""A user's own add-on by `_target_` (trainer.callbacks, runner/addons/base.py): it trains, checkpoints and
comes back on resume; a target that cannot be imported, is no add-on, or gets a key it does not take is one
line naming the key before training (tests/runner/test_bad_input.py runs those through the CLI too)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from runner.cli import launch
from runner.engine import checkpoint
from runner.spec import components
from runner.spec.run import SpecError
from tests.conftest import compose_spec

COUNTER = "{_target_: tests.user_pkg.callbacks.StepCounter, scale: 10}"
RUN = ["trainer.max_steps=6", "trainer.eval_every_n_steps=2", "trainer.eval_every_epoch=false", "dataset.batch_size=32",
       "trainer.progress_bar=off", "trainer.memory_estimate=false", f"trainer.callbacks=[{COUNTER}]"]


def test_a_user_callback_trains_checkpoints_and_its_state_comes_back_on_resume(tmp_path: Path, store: str) -> None:
    """Paused at step 4 (its checkpoint holds the callback's counts), resumed in place to step 6: the counts go
    on from the checkpoint's (6 steps, 3 validations, 6 x 32 samples), logged at each validation's step."""
    run_dir = tmp_path / "run"
    first = launch.run(compose_spec([*RUN, "trainer.stop_at_step=4"], run_dir, store))
    assert first.steps == 4
    assert checkpoint.load(run_dir)["addons"]["step_counter"] == {"steps": 4, "samples": 128, "evaluations": 2}
    second = launch.run(compose_spec([*RUN, f"trainer.resume={run_dir}"], tmp_path / "ignored", store))
    assert second.steps == 6
    assert checkpoint.load(run_dir)["addons"]["step_counter"] == {"steps": 6, "samples": 192, "evaluations": 3}
    client = MlflowClient(store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    logged = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"user/{key}")}
              for key in ("steps", "samples", "evaluations")}
    assert logged == {"steps": {2: 20, 4: 40, 6: 60}, "samples": {2: 640, 4: 1280, 6: 1920},
                      "evaluations": {2: 10, 4: 20, 6: 30}}
    saved = yaml.safe_load((run_dir / "spec.yaml").read_text())  # the resolved record: its arguments included
    assert saved["trainer"]["callbacks"] == [{"_target_": "tests.user_pkg.callbacks.StepCounter", "scale": 10}]


@pytest.mark.parametrize("callback, message", [
    ("{_target_: tests.user_pkg.callbacks.NoSuchCallback}",
     "trainer.callbacks[0]._target_: cannot import 'tests.user_pkg.callbacks.NoSuchCallback'"),
    ("{_target_: tests.user_pkg.callbacks.NotAnAddOn}",
     "trainer.callbacks[0]._target_: tests.user_pkg.callbacks.NotAnAddOn is not an engine add-on; give a class that "
     "subclasses runner.addons.base.AddOn"),
    ("{_target_: tests.user_pkg.callbacks.StepCounter, scael: 2}",
     "trainer.callbacks[0].scael: unknown key for tests.user_pkg.callbacks.StepCounter; did you mean scale? "
     "accepted keys: scale"),
    ("{_target_: tests.user_pkg.callbacks.StepCounter, scale: two}",
     "trainer.callbacks[0].scale: 'two' is not an integer"),
])
def test_a_bad_callback_is_one_line_naming_its_key_before_training(tmp_path: Path, callback: str, message: str) -> None:
    spec = compose_spec([f"trainer.callbacks=[{callback}]"], tmp_path / "run")
    with pytest.raises(SpecError) as error:
        components.resolved_spec(spec)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_a_callback_refusing_its_value_is_one_line_naming_the_key(tmp_path: Path) -> None:
    spec = compose_spec([f"trainer.callbacks=[{{_target_: tests.user_pkg.callbacks.StepCounter, scale: 0}}]"],
                        tmp_path / "run")
    with pytest.raises(SpecError, match=r"^trainer\.callbacks\[0\]\.scale: 0 is not allowed; give a whole number >= 1$"):
        components.build_callbacks(components.resolved_spec(spec))
