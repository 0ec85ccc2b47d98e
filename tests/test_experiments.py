"""The experiment presets train through `python -m runner experiment=<name>`: each on small data written
in its real on-disk format (CI variants of the full recipes, which README documents)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.data.test_text import write_imdb
from tests.data.test_torchvision_datasets import _write_cifar


def best(stdout: str, metric: str) -> float:
    return float(stdout.split(f"best {metric}: ")[1].split()[0])


@pytest.mark.slow  # CI budget; the CIFAR reader: tests/data/test_cifar.py
def test_cifar10_resnet_trains_on_files_in_the_cifar_format(tmp_path: Path) -> None:
    _write_cifar(tmp_path / "data", per_batch=40)
    # with mixup and cutmix on: soft labels through the classification loss (evaluation stays hard-labelled)
    proc = run_cli(["experiment=cifar10_resnet", f"dataset.root={tmp_path / 'data'}", "precision=fp32",
                    "dataset.batch_size=32", "dataset.num_workers=0", "dataset.mixup_alpha=0.2", "dataset.cutmix_alpha=1.0",
                    "trainer.max_epochs=1", "tracking=none"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spec = next((tmp_path / "outputs" / "runs").glob("*/*/spec.yaml")).read_text()
    assert "label_smoothing: 0.1" in spec and "nesterov: true" in spec and "_target_: runner.engine.schedule.onecycle" in spec
    assert "crop_padding: 4" in spec and "hflip: true" in spec
    assert 0.0 <= best(proc.stdout, "val/acc") <= 1.0


def test_imdb_distilbert_fine_tunes_on_reviews_in_the_imdb_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Through the CLI's entry in this process (an interpreter start, with transformers, saved; the presets
    in real processes: tests/test_experiments_parallel.py and the sweep below)."""
    from tests.runner.test_bad_input import RUN, run_in_process

    pytest.importorskip("transformers")
    write_imdb(tmp_path / "data", n_train=24, n_test=8)
    tiny = ["model.config.dim=32", "model.config.n_layers=1", "model.config.n_heads=2", "model.config.hidden_dim=64"]
    code, out, err = run_in_process(["experiment=imdb_distilbert", f"dataset.root={tmp_path / 'data'}",
                                     "dataset.max_length=64", "dataset.vocab_size=300", "dataset.batch_size=8", *tiny,
                                     "trainer.max_epochs=1", "tracking=none"], tmp_path, RUN, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    spec = next((tmp_path / "outputs" / "runs").glob("*/*/spec.yaml")).read_text()
    assert "_target_: runner.models.hf.hf_model" in spec and "clip_grad_norm: 1.0" in spec and "_target_: runner.engine.schedule.wsd" in spec
    assert 0.0 <= best(out + err, "val/acc") <= 1.0


def _entropy(root: Path, **kwargs) -> float:
    from runner.data.corpus import corpus, unigram_entropy

    return unigram_entropy(corpus(root=str(root), **kwargs).train.tokens())


@pytest.mark.slow  # CI budget; the preset trains in test_experiments_parallel
def test_gpt_small_learns_the_offline_corpus_below_its_unigram_entropy(tmp_path: Path) -> None:
    """A CI-sized run of the preset: 300k characters of the standard library, 150 steps."""
    data = ["dataset.max_chars=300000", "dataset.block_size=64", "dataset.vocab_size=1024"]
    proc = run_cli(["experiment=gpt_small", *data, f"dataset.root={tmp_path / 'data'}", "trainer.max_steps=150",
                    "trainer.eval_every_n_steps=150", "tracking=none"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    entropy = _entropy(tmp_path / "data", max_chars=300000, vocab_size=1024)
    loss = best(proc.stdout, "val/loss")
    assert math.isfinite(loss) and loss < entropy - 1.0, (loss, entropy)  # well below: a nat or more


@pytest.mark.slow
def test_gpt_small_as_documented_beats_the_unigram_entropy_within_two_minutes(tmp_path: Path) -> None:
    proc = run_cli(["experiment=gpt_small", f"dataset.root={tmp_path / 'data'}", "tracking=none"], tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seconds = float(proc.stdout.split("optimizer steps in ")[1].split()[0])
    print(f"gpt_small: {seconds:.0f} s of training, best val/loss {best(proc.stdout, 'val/loss'):.3f}")
    assert best(proc.stdout, "val/loss") < _entropy(tmp_path / "data", max_chars=5_000_000, vocab_size=4096) - 1.0


@pytest.mark.usefixtures("store")  # its tmp_path/mlflow.db comes migrated (tests/conftest.py): seconds saved
def test_an_optuna_study_searches_the_gpt_presets_model_shape_and_optimizer(tmp_path: Path) -> None:
    """hparams_search=gpt_small_optuna, shrunk: each trial trains the sampled shape, and the study's value of a
    trial is that run's best val/loss as MLflow recorded it."""
    import optuna
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    from runner.search.trial import RUN_DIR_ATTR
    from tests.runner.search.test_hparams_search import load, run_of

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli(["-m", "hparams_search=gpt_small_optuna", "hydra.sweeper.n_trials=2", "model.n_embd=choice(32,64)",
                    "model.n_head=2", "dataset.max_chars=60000", "dataset.block_size=32", "dataset.vocab_size=300",
                    "trainer.max_steps=6", "trainer.eval_every_n_steps=3", f"dataset.root={tmp_path / 'data'}",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}", f"tracking.uri={uri}", "trainer.progress_bar=off"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(tmp_path / "sweep" / "optuna.journal", "gpt_small_optuna")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    client = MlflowClient(uri)
    for trial in study.trials:
        run_dir = Path(trial.system_attrs[RUN_DIR_ATTR])
        spec = yaml.safe_load((run_dir / "spec.yaml").read_text())
        assert (spec["model"]["n_layer"], spec["model"]["n_embd"]) == (trial.params["model.n_layer"], trial.params["model.n_embd"])
        assert spec["optimizer"]["lr"] == trial.params["optimizer.lr"] and spec["task"]["_target_"] == "runner.tasks.LanguageModeling"
        val = [m.value for m in client.get_metric_history(run_of(trial), "val/loss")]
        assert len(val) == 2 and trial.value == pytest.approx(min(val), rel=1e-9)
    assert len({(t.params["model.n_layer"], t.params["model.n_embd"], t.params["optimizer.lr"]) for t in study.trials}) == 2
