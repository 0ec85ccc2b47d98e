"""A user's own optimizer, schedule and loss (tests/user_pkg/training.py), named only by `_target_`, from YAML
on hydra.searchpath or on the command line, train like the built-ins; spec.yaml and MLflow hold their keys only."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.engine.engine import Engine
from tests.conftest import REPO, compose_spec
from tests.runner.engine.test_parallel import metric_history
from tests.user_pkg.training import FocalLoss, Lion

SEARCH = f"hydra.searchpath=[file://{REPO / 'tests' / 'user_pkg' / 'conf'}]"
FAST = ["trainer.max_steps=6", "trainer.log_every_n_steps=1", "trainer.eval_every_epoch=false",
        "trainer.progress_bar=off", "dataset.batch_size=16"]


def test_a_users_optimizer_schedule_and_loss_from_yaml_train_from_the_command_line(tmp_path: Path, monkeypatch,
                                                                                 capsys: pytest.CaptureFixture) -> None:
    import yaml

    # through the CLI's entry in this process (an interpreter start saved, CI budget; the user's package is
    # importable here as PYTHONPATH or an install makes it for their own project)
    from tests.runner.test_bad_input import RUN, run_in_process

    code, out, err = run_in_process([SEARCH, "optimizer=lion", "scheduler=halving", "task=focal", "trainer.max_steps=2",
                                     "trainer.eval_every_epoch=false", "tracking=none", f"hydra.run.dir={tmp_path / 'run'}"],
                                    tmp_path, RUN, monkeypatch, capsys)
    assert code == 0 and "trained 2 optimizer steps" in out, err[-3000:]
    spec = yaml.safe_load((tmp_path / "run" / "spec.yaml").read_text())
    assert (spec["task"], spec["scheduler"]) == ({"_target_": "tests.user_pkg.training.FocalLoss", "gamma": 2.0},
                                                 {"_target_": "tests.user_pkg.training.halving", "every": 5})


@pytest.mark.usefixtures("store")  # its tmp_path/mlflow.db comes migrated (tests/conftest.py): seconds saved
def test_mlflow_holds_only_the_chosen_parts_keys_and_the_users_schedule(tmp_path: Path) -> None:
    import mlflow

    from runner.cli.launch import run

    db = tmp_path / "mlflow.db"
    run(compose_spec([SEARCH, "optimizer=lion", "scheduler=halving", "task=focal", *FAST], tmp_path / "run",
                     tracking_uri=f"sqlite:///{db}"))
    # halving every 5 steps from lr 3e-4: the lr a step used (steps 1..6), or the one after it
    used = [3e-4 * 0.5 ** (k // 5) for k in range(7)]
    lrs = [v for _, v in metric_history(db)["lr"]]
    assert lrs in ([pytest.approx(x) for x in used[:6]], [pytest.approx(x) for x in used[1:]])
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    params = mlflow.search_runs(experiment_names=["runner"], output_format="list")[0].data.params
    own = {k: v for k, v in params.items() if k.split(".")[0] in ("task", "optimizer", "scheduler")}
    assert own == {"task._target_": "tests.user_pkg.training.FocalLoss", "task.gamma": "2.0",
                   "optimizer._target_": "tests.user_pkg.training.Lion", "optimizer.lr": "0.0003",
                   "optimizer.betas": "[0.9, 0.99]", "optimizer.weight_decay": "0.0", "optimizer.impl": "auto",
                   "optimizer.decay_norm_and_bias": "False", "optimizer.lr_multipliers": "None",
                   "scheduler._target_": "tests.user_pkg.training.halving", "scheduler.every": "5"}


def engine(overrides: list[str], run_dir: Path) -> Engine:
    return Engine(compose_spec(["trainer.max_steps=4", "trainer.eval_every_epoch=false", "trainer.progress_bar=off",
                                "dataset.batch_size=16", *overrides], run_dir))


def test_targets_on_the_command_line_start_from_their_own_signature(tmp_path: Path) -> None:
    """optimizer._target_=torch.optim.NAdam, a schedule function and a loss class given on the command line:
    the schedule's lr is exact, and the loss is the one trained (focal with gamma 0 is cross-entropy)."""
    run = engine(["optimizer._target_=torch.optim.NAdam", "scheduler._target_=tests.user_pkg.training.halving",
                  "+scheduler.every=2", "task._target_=tests.user_pkg.training.FocalLoss", "+task.gamma=0.0"],
                 tmp_path / "focal0")
    assert isinstance(run.optimizer, torch.optim.NAdam) and isinstance(run.task, FocalLoss) and run.task.gamma == 0.0
    assert run.spec.to_dict()["task"] == {"_target_": "tests.user_pkg.training.FocalLoss", "gamma": 0.0}
    assert run.spec.to_dict()["scheduler"] == {"_target_": "tests.user_pkg.training.halving", "every": 2}
    run.fit()
    # a typed _target_ starts from its own signature: NAdam's lr 2e-3, halved twice in 4 steps
    assert [g["lr"] for g in run.optimizer.param_groups] == [pytest.approx(2e-3 * 0.5 ** 2)] * 2
    plain = engine(["optimizer._target_=torch.optim.NAdam", "scheduler._target_=tests.user_pkg.training.halving",
                    "+scheduler.every=2"], tmp_path / "ce")
    plain.fit()
    focal = engine(["optimizer._target_=torch.optim.NAdam", "scheduler._target_=tests.user_pkg.training.halving",
                    "+scheduler.every=2", "task._target_=tests.user_pkg.training.FocalLoss"], tmp_path / "focal2")
    focal.fit()
    for key, value in plain.module.state_dict().items():
        torch.testing.assert_close(run.module.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(focal.module.state_dict()["1.weight"], plain.module.state_dict()["1.weight"])


def test_a_users_optimizer_honours_runners_parameter_groups(tmp_path: Path) -> None:
    """Lion gets runner's groups: no weight decay on biases and norm gains, lr multipliers (0: frozen)."""
    run = engine(["optimizer._target_=tests.user_pkg.training.Lion", "optimizer.weight_decay=0.1",
                  "optimizer.lr_multipliers={5.weight: 0, 5.bias: 0}"], tmp_path / "run")
    start = {k: v.detach().clone() for k, v in run.module.state_dict().items()}
    run.fit()
    assert isinstance(run.optimizer, Lion)
    assert sorted((g["lr"], g["weight_decay"]) for g in run.optimizer.param_groups) == [  # Lion's own lr 1e-4
        (0.0, 0.0), (0.0, 0.1), (1e-4, 0.0), (1e-4, 0.1)]
    after = run.module.state_dict()
    assert [k for k in start if torch.equal(start[k], after[k])] == ["5.weight", "5.bias"]
