"""A user's own model and dataset, named only from YAML on hydra.searchpath, train like the built-ins:
exact accumulation in tokens with padded labels, ddp equal to one process, resume, and a sweep."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner import checkpoint
from runner.engine import Engine
from tests.conftest import REPO, compose_spec, run_cli

SEARCH = f"hydra.searchpath=[file://{REPO / 'tests' / 'user_pkg' / 'conf'}]"
LM = ["task=language_modeling", "dataset=padded_tokens", "model=gpt", "model.size=tiny", "model.n_embd=32",
      "model.n_head=2", "optimizer=adamw", "trainer.progress_bar=off", "trainer.max_epochs=2"]


def compose(overrides: list[str], run_dir: Path):
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner.registry import CONF_DIR
    from runner.spec import RunSpec

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


def test_a_users_model_and_dataset_from_yaml_alone_train_under_ddp_and_fsdp_like_one_process(tmp_path: Path, user_path) -> None:
    common = [SEARCH, *LM, "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_epochs=1", "tracking=none"]  # sgd: see above
    single = run_cli([*common, "dataset.batch_size=8", f"hydra.run.dir={tmp_path / 'one'}"], tmp_path)
    assert single.returncode == 0, single.stderr[-2000:]
    two = run_cli([*common, "dataset.batch_size=4", "parallelism=ddp", "parallelism.nproc_per_node=2",
                   f"hydra.run.dir={tmp_path / 'two'}"], tmp_path, timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    fsdp = run_cli([*common, "dataset.batch_size=4", "parallelism=fsdp", "parallelism.nproc_per_node=2", "+accum=1",
                    f"hydra.run.dir={tmp_path / 'fsdp'}"], tmp_path, timeout=300)
    assert fsdp.returncode == 0, fsdp.stderr[-2000:]
    a, b, c = (checkpoint.load(tmp_path / d / "checkpoints" / "last.pt")["model"] for d in ("one", "two", "fsdp"))
    for key in a:
        torch.testing.assert_close(c[key], a[key], rtol=1e-5, atol=1e-5 * a[key].abs().max().item())
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-5 * a[key].abs().max().item())
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


def test_an_optuna_study_searches_a_key_of_the_users_own_model(tmp_path: Path, user_path) -> None:
    import yaml
    from optuna.trial import TrialState

    from runner.trial import RUN_DIR_ATTR
    from tests.runner.test_hparams_search import load

    proc = run_cli(["-m", SEARCH, "hparams_search=digits_optuna", "model=wide_net", "model.width=choice(8,16,24)",
                    "hydra.sweeper.n_trials=2", "trainer.max_steps=6", "trainer.progress_bar=off", "tracking=none",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(tmp_path / "sweep" / "optuna.journal")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for trial in study.trials:
        spec = yaml.safe_load((Path(trial.system_attrs[RUN_DIR_ATTR]) / "spec.yaml").read_text())
        assert spec["model"]["_target_"] == "tests.models.user_net.WideNet"
        assert spec["model"]["width"] == trial.params["model.width"] in (8, 16, 24)
        assert 0.0 <= trial.value <= 1.0  # the best val/acc of the run
