"""A user's own add-on by `_target_` (trainer.callbacks, runner/addons/base.py): it trains, checkpoints and
comes back on resume; a target that cannot be imported, is no add-on, or gets a key it does not take is one
line naming the key before training (tests/runner/test_bad_input.py runs those through the CLI too)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from runner.cli import launch
from runner.engine import checkpoint
from runner.engine.components import build_callbacks
from runner.specs import components
from runner.specs.run import SpecError
from tests.conftest import REPO, compose_spec, run_cli

COUNTER = "{_target_: tests.user_pkg.callbacks.StepCounter, scale: 10}"


@pytest.fixture(autouse=True)
def _user_package_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The callbacks' package (tests.user_pkg) importable in `python -m runner`, as a user's own project is
    (PYTHONPATH or an install): the CLI's runs start in a temporary directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


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
        build_callbacks(components.resolved_spec(spec))


FAST = ["trainer.max_steps=4", "trainer.eval_every_n_steps=2", "trainer.eval_every_epoch=false", "dataset.batch_size=32",
        "trainer.progress_bar=off", "trainer.memory_estimate=false"]


@pytest.mark.parametrize("what, held", [("lock", "_thread.lock"), ("lambda", "builtins.function")])
def test_a_callback_whose_state_no_checkpoint_can_store_is_one_line_before_training(tmp_path: Path, store: str,
                                                                                    what: str, held: str) -> None:
    """Issue 35 item 9: a lock or a lambda in a callback's state_dict was a 50-line pickling traceback at the
    first checkpoint, and no checkpoint; now one line naming the callback and the entry, before the first step."""
    out = run_cli([*FAST, f"trainer.callbacks=[{{_target_: tests.user_pkg.callbacks.HoldsALock, what: {what}}}]",
                   f"tracking.uri={store}", "hydra.run.dir=run"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: trainer.callbacks[0] (tests.user_pkg.callbacks.HoldsALock): state_dict()['guard'] is {held}, which a "
        "checkpoint cannot store; return numbers, strings, tensors and lists or dicts of them (leave out locks, "
        "functions and other objects, or rebuild them in load_state_dict)")
    assert "Traceback" not in out.stderr and not checkpoint.has_checkpoint(tmp_path / "run")
    client = MlflowClient(store)
    assert [r.info.status for r in client.search_runs([e.experiment_id for e in client.search_experiments()])] in (
        [], ["FAILED"])  # never left RUNNING


def test_a_hook_returning_what_no_hook_returns_is_one_line_naming_the_callback(tmp_path: Path) -> None:
    """Issue 35 item 9: on_step_end returning a string was a 31-line AttributeError."""
    out = run_cli([*FAST, "trainer.callbacks=[{_target_: tests.user_pkg.callbacks.ReturnsAString}]", "tracking=none",
                   "hydra.run.dir=run"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "error: trainer.callbacks[0] (tests.user_pkg.callbacks.ReturnsAString): on_step_end returned 'stop' (str); a "
        "hook returns runner.addons.base.Stop(reason) to end training at this step, or None to go on")
    assert "Traceback" not in out.stderr


def test_a_paused_run_resumes_with_its_own_command_and_a_callback_of_default_arguments(tmp_path: Path) -> None:
    """Issue 35 item 9: the saved spec holds the callback's defaults (scale: 1), the command typed them not: the
    resume compared the two and refused its own command."""
    command = [*FAST, "trainer.callbacks=[{_target_: tests.user_pkg.callbacks.StepCounter}]", "tracking=none",
               "hydra.run.dir=run"]
    first = run_cli([*command, "trainer.stop_at_step=2"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli([*command, "trainer.resume=run"], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert checkpoint.load(tmp_path / "run")["addons"]["step_counter"] == {"steps": 4, "samples": 128, "evaluations": 2}


@pytest.mark.parametrize("value", ["{_target_: tests.user_pkg.callbacks.StepCounter}", "3"])
def test_trainer_callbacks_that_is_no_list_says_what_the_key_takes(tmp_path: Path, value: str) -> None:
    """Issue 35 item 9: a mapping or a number got OmegaConf's words ("Cannot merge DictConfig with ListConfig")."""
    out = run_cli([f"trainer.callbacks={value}", "tracking=none", "hydra.run.dir=run"], tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: trainer.callbacks: {value} is not a list; give a list of add-ons, each {{_target_: my_pkg.MyCallback, "
        "...its arguments} (a subclass of runner.addons.base.AddOn), e.g. trainer.callbacks=[{_target_: "
        "my_pkg.MyCallback}]"]
    assert not (tmp_path / "run").exists()
