"""A user's own model and dataset, named only from YAML on hydra.searchpath, train like the built-ins:
exact accumulation in tokens with padded labels, ddp equal to one process, resume, and a sweep."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.engine import checkpoint
from runner.engine.engine import Engine
from tests.conftest import REPO, compose_spec, run_cli

SEARCH = f"hydra.searchpath=[file://{REPO / 'tests' / 'user_pkg' / 'conf'}]"
LM = ["task=language_modeling", "dataset=padded_tokens", "model=gpt", "model.size=tiny", "model.n_embd=32",
      "model.n_head=2", "optimizer=adamw", "trainer.progress_bar=off", "trainer.max_epochs=2"]


def compose(overrides: list[str], run_dir: Path):
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner.specs.registry import CONF_DIR
    from runner.specs.run import RunSpec

    overrides = [*overrides, "tracking=none"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[*overrides, SEARCH])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    container["run_dir"] = str(run_dir)
    return RunSpec.from_config(container, tuple(overrides))


def weights(engine: Engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_language_modelling_accumulates_exactly_in_tokens_with_padded_labels(tmp_path: Path) -> None:
    """Micro-batches hold different numbers of counted tokens: the step's mean is over all of them.
    SGD: Adam would turn the float noise of gradients that are zero in exact arithmetic (an attention key
    bias) into full-size steps of either sign."""
    sgd = ["optimizer=sgd", "optimizer.lr=0.5"]
    big = Engine(compose([*LM, *sgd, "dataset.batch_size=8"], tmp_path / "big"))
    big.fit()
    small = Engine(compose([*LM, *sgd, "dataset.batch_size=4", "+accum=2"], tmp_path / "small"))
    small.fit()
    assert big.progress.step == small.progress.step == 2 * 12  # 90 sequences, 8 a step: 12 steps an epoch
    for key, value in weights(big).items():  # the tolerance the engine's own accumulation tests use
        torch.testing.assert_close(weights(small)[key], value, rtol=1e-5, atol=1e-5 * value.abs().max().item())
    # the check has power: normalising per micro-batch instead would differ
    assert big.task.count(torch.tensor([[1, -100], [2, 3]])) == 3


@pytest.fixture
def user_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's package importable, as their own project would be (PYTHONPATH or an install)."""
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


@pytest.mark.slow  # CI budget; a user's data from the search path under ddp and fsdp: the empty-share cases
def test_a_users_model_and_dataset_from_yaml_alone_train_under_ddp_and_fsdp_like_one_process(tmp_path: Path, user_path) -> None:
    """89 sequences at 2 x 4 (and 17 in val and test): the second rank's share of each split's last batch
    is empty, a dict batch whose stand-in must count no token."""
    from tests.runner.engine.test_parallel import metric_history

    common = [SEARCH, *LM, "dataset.size=89", "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_epochs=1",
              "trainer.log_every_n_steps=1", f"tracking.artifact_root={tmp_path / 'artifacts'}"]  # sgd: see above
    runs = {"one": ["dataset.batch_size=8"], "two": ["dataset.batch_size=4", "parallelism=ddp", "parallelism.nproc_per_node=2"],
            "fsdp": ["dataset.batch_size=4", "parallelism=fsdp", "parallelism.nproc_per_node=2", "+accum=1"]}
    for name, args in runs.items():
        proc = run_cli([*common, *args, f"hydra.run.dir={tmp_path / name}", f"tracking.uri=sqlite:///{tmp_path}/{name}.db"],
                       tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    a, b, c = (checkpoint.load(tmp_path / d / "checkpoints" / "last.pt")["model"] for d in runs)
    for key in a:
        torch.testing.assert_close(c[key], a[key], rtol=1e-5, atol=1e-5 * a[key].abs().max().item())
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5 * a[key].abs().max().item())
    one = metric_history(tmp_path / "one.db")
    for other in ("two", "fsdp"):
        logged = metric_history(tmp_path / f"{other}.db")
        for key in ("train/loss", "val/loss", "test/loss"):
            assert [s for s, _ in logged[key]] == [s for s, _ in one[key]], key
            assert [v for _, v in logged[key]] == pytest.approx([v for _, v in one[key]], rel=1e-5), key
    assert "_target_: tests.user_pkg.tokens.build" in (tmp_path / "one" / "spec.yaml").read_text()


@pytest.mark.slow
def test_a_users_classifier_resumes_in_place_and_sweeps(tmp_path: Path, user_path) -> None:
    common = [SEARCH, "model=wide_net", "trainer.progress_bar=off", "tracking=none"]
    first = run_cli([*common, "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3",
                     f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    longer = run_cli([SEARCH, f"trainer.resume={tmp_path / 'run'}", "trainer.max_steps=9",
                      f"hydra.run.dir={tmp_path / 'again'}"], tmp_path)
    assert longer.returncode == 0 and "runner: trained 9 optimizer steps" in longer.stdout, longer.stderr[-2000:]
    sweep = run_cli(["-m", *common, "trainer.max_steps=4", "model.width=16,32", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                    tmp_path)
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    specs = sorted((tmp_path / "sweep").glob("*/spec.yaml"))
    assert [("width: 16" in s.read_text(), "width: 32" in s.read_text()) for s in specs] == [(True, False), (False, True)]


def test_regression_learns_with_mse_reports_mae_and_accumulates_exactly(tmp_path: Path) -> None:
    """num_classes doubles as the output width for the mlp; the loss is MSE per sample, so micro-batches
    of unequal size (a ragged last one) still give the mean over the step's samples."""
    common = ["task=regression", "dataset=linear_targets", "model.hidden=[16]", "optimizer=sgd", "optimizer.lr=0.05",
              "trainer.max_epochs=3", "trainer.progress_bar=off"]
    big = Engine(compose([*common, "dataset.batch_size=30"], tmp_path / "big"))
    result = big.fit()
    small = Engine(compose([*common, "dataset.batch_size=10", "+accum=3"], tmp_path / "small"))
    small.fit()
    for key, value in weights(big).items():
        torch.testing.assert_close(weights(small)[key], value, rtol=1e-5, atol=1e-5 * value.abs().max().item())
    history = big.monitor.history
    assert set(result.final) == {"test/loss", "test/mae"} and history["val/loss"][-1][1] < history["val/loss"][0][1]
    assert big.spec.objective.metric == "val/loss" and result.objective == min(v for _, v in history["val/loss"])


def test_an_optuna_study_searches_a_key_of_the_users_own_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture) -> None:
    """Through the CLI's entry in this process (an interpreter start saved; n_jobs=1 runs the trials in the
    sweep's process; a runner sweep from a real process: tests/test_experiments.py's gpt study)."""
    import yaml
    from optuna.trial import TrialState

    from runner.search.trial import RUN_DIR_ATTR
    from tests.runner.search.test_hparams_search import load
    from tests.runner.test_bad_input import RUN, run_in_process

    code, _, err = run_in_process(["-m", SEARCH, "hparams_search=digits_optuna", "model=wide_net",
                                   "model.width=choice(8,16,24)", "hydra.sweeper.n_trials=2", "trainer.max_steps=6",
                                   "trainer.progress_bar=off", "tracking=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                                  tmp_path, RUN, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    study = load(tmp_path / "sweep" / "optuna.journal")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for trial in study.trials:
        spec = yaml.safe_load((Path(trial.system_attrs[RUN_DIR_ATTR]) / "spec.yaml").read_text())
        assert spec["model"]["_target_"] == "tests.models.user_net.WideNet"
        assert spec["model"]["width"] == trial.params["model.width"] in (8, 16, 24)
        assert 0.0 <= trial.value <= 1.0  # the best val/acc of the run


# A rank whose share of a split's last batch is empty (tests/user_pkg/shares.py: 25, 9 and 9 samples at
# 2 x 4) gets a stand-in that counts 0: 2 ranks then log and train like one process. CI: the dict
# layout with a model's own loss under ddp, the tuple layout with regression under fsdp; language
# modelling with dict batches: the test above. The rest slow. The ddp case runs through the CLI's
# launcher (the user's model and data named in its workers); the others on the session's two ranks
# (tests/conftest.py: a launch costs three interpreter starts, CI budget).
OWN_LOSS_DICT = ["dataset.layout=dict", "model._target_=tests.user_pkg.shares.OwnLossNet", "objective.metric=val/loss",
                 "objective.direction=minimize"]
REGRESSION_TUPLE = ["task=regression", "dataset.targets=values"]
CLASSES_TUPLE = ["model.hidden=[16]"]
EMPTY_SHARE = [("ddp", OWN_LOSS_DICT), ("fsdp", REGRESSION_TUPLE),
               pytest.param("fsdp", OWN_LOSS_DICT, marks=pytest.mark.slow),
               pytest.param("ddp", REGRESSION_TUPLE, marks=pytest.mark.slow),
               pytest.param("ddp", CLASSES_TUPLE, marks=pytest.mark.slow),
               pytest.param("fsdp", CLASSES_TUPLE, marks=pytest.mark.slow)]


@pytest.mark.parametrize("strategy, kind", EMPTY_SHARE, ids=lambda v: v if isinstance(v, str) else v[0])
def test_an_empty_rank_share_adds_nothing_two_ranks_log_and_train_like_one_process(tmp_path: Path, user_path,
                                                                                  strategy: str, kind: list,
                                                                                  migrated_mlflow_store: Path,
                                                                                  two_ranks) -> None:
    import shutil

    from runner.tracking.tracker import build_tracker
    from tests.runner.engine.test_parallel import assert_same, final_weights, fit_on_rank, metric_history

    for db in ("one.db", "two.db"):  # migrated once (tests/conftest.py): no first open of a store is tested here
        shutil.copy(migrated_mlflow_store, tmp_path / db)
    common = [SEARCH, "dataset=shares", *kind, "optimizer=sgd", "optimizer.lr=0.2", "trainer.max_epochs=2",
              "trainer.log_every_n_steps=1", "trainer.progress_bar=off"]
    spec = compose_spec([*common, "dataset.batch_size=8"], tmp_path / "one", tracking_uri=f"sqlite:///{tmp_path}/one.db")
    Engine(spec, build_tracker(spec)).fit()
    two = [*common, "dataset.batch_size=4", f"parallelism={strategy}", "parallelism.nproc_per_node=2"]
    if (strategy, kind) == ("ddp", OWN_LOSS_DICT):
        proc = run_cli([*two, f"hydra.run.dir={tmp_path / 'two'}", f"tracking.uri=sqlite:///{tmp_path}/two.db",
                        f"tracking.artifact_root={tmp_path / 'artifacts'}"], tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        two_ranks.run(fit_on_rank, two, str(tmp_path / "two"), str(tmp_path / "two.db"))
    assert_same(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))
    one, two = metric_history(tmp_path / "one.db"), metric_history(tmp_path / "two.db")
    for key in ("train/loss", "val/loss", "test/loss"):
        assert len(one[key]) > 0 and [s for s, _ in two[key]] == [s for s, _ in one[key]], key
        for (_, a), (_, b) in zip(one[key], two[key]):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7), key


@pytest.mark.slow  # the crash it guards against is covered in CI by tests/runner/test_tasks.py's stand-in cases
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_mixup_with_an_empty_rank_share_trains(tmp_path: Path, user_path, strategy: str) -> None:
    """Mixup pairs samples within a rank's batch, so 2 ranks cannot equal one process; the stand-in must
    still count nothing (it raised 'Class values must be non-negative' on its -100 labels)."""
    from tests.runner.engine.test_parallel import metric_history

    proc = run_cli([SEARCH, "dataset=shares", "dataset.mixup_alpha=0.4", "trainer.max_epochs=2",
                    "trainer.progress_bar=off", f"parallelism={strategy}", "parallelism.nproc_per_node=2",
                    f"hydra.run.dir={tmp_path / 'two'}", f"tracking.uri=sqlite:///{tmp_path}/two.db",
                    f"tracking.artifact_root={tmp_path / 'artifacts'}"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(0 < v < 10 for _, v in metric_history(tmp_path / "two.db")["train/loss"])
