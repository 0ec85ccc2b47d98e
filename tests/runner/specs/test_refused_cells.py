"""Every refused cell of the composition table (runner/specs/composition.py: TABLE and PAIRS), run as its
command: one `error:` line naming the feature's key and the dimension's, exit 2, no traceback, nothing made
(no run or sweep directory, no outputs/). The command goes through the CLI's own checks in this process
(preflight, then the launcher's check_parallel for what the model decides, as `python -m runner` calls them
before any worker starts); test_composition.py runs the CLI as a subprocess for one of each kind.

The cells are read from the table, so a cell turned to refused is tested here at once, and a feature the
table gains without a way to turn it on here fails `test_every_refused_cell_has_a_command`.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from runner.specs import composition

LM = ["task=language_modeling", "model=gpt", "dataset=synthetic_tokens", "model.n_layer=2", "model.n_embd=16",
      "model.n_head=2", "dataset.batch_size=8"]
CNN = ["model=cnn", "dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.batch_size=8"]
# the keys that make each dimension's degree 2 (cp with the language model: its attention is what cp splits)
DIMENSION_KEYS = {
    "dp_replicate": ["parallelism=ddp", "parallelism.nproc_per_node=2"],
    "dp_shard": ["parallelism=fsdp", "parallelism.nproc_per_node=2"],
    "tp": ["parallelism.tp=2"],
    "pp": ["parallelism.pp=2"],
    "cp": ["parallelism.cp=2"],
}
# what the refusal names for the dimension: the key typed, or the preset that set it
DIMENSION_SHOWN = {"dp_replicate": "parallelism=ddp", "dp_shard": "parallelism=fsdp", "tp": "parallelism.tp=2",
                   "pp": "parallelism.pp=2", "cp": "parallelism.cp=2"}
# the keys that turn each feature on (a sweep: "-m" first) and the key its refusal names
FEATURE_KEYS: dict[str, tuple[list[str], str]] = {
    "accumulation": (["+accum=2"], "accumulation.steps"),
    "clipping": (["trainer.clip_grad_norm=1.0"], "trainer.clip_grad_norm"),
    "ema": (["trainer.ema.decay=0.9"], "trainer.ema.decay"),
    "swa": (["trainer.swa.start_epoch=1"], "trainer.swa.start_epoch"),
    "batchnorm": ([], "BatchNorm layer"),  # the model's: CNN
    "sync_batchnorm": (["parallelism.sync_batchnorm=true"], "parallelism.sync_batchnorm"),
    "compile": (["trainer.compile=true"], "trainer.compile"),
    "activation_checkpointing": (["trainer.activation_checkpointing=full"], "trainer.activation_checkpointing"),
    "finders": (["tune=lr_find"], "tune=lr_find"),
    "kfold": (["trainer.cross_validation.folds=2"], "trainer.cross_validation.folds"),
    "pbt": (["-m", "hparams_search=digits_pbt"], "hydra/sweeper=pbt"),
    "optuna": (["-m", "hparams_search=digits_optuna"], "hydra/sweeper=runner_optuna"),
    "test_on_best": (["trainer.test_on=best"], "trainer.test_on"),
    "modes": (["mode=eval", "trainer.resume={resume}"], "mode=eval"),
    "log_model": (["tracking.log_model=last"], "tracking.log_model"),
    "memory_estimate": (["trainer.memory_estimate=true"], "trainer.memory_estimate"),
    "profiler": (["trainer.profile=true"], "trainer.profile"),
    "callbacks": (["+trainer.callbacks=[{_target_:tests.user_pkg.callbacks.StepCounter}]"], "trainer.callbacks"),
    "fp16": (["precision=fp16"], "precision=fp16"),
}
REFUSED = [(feature, dim) for feature, cells in composition.TABLE.items() for dim, cell in cells.items()
           if not cell.built]
PAIRS = {
    "pp x cp": [*LM, "parallelism.pp=2", "parallelism.cp=2"],
    "pp x fsdp x tp": [*LM, "parallelism=fsdp", "parallelism.nproc_per_node=8", "parallelism.pp=2", "parallelism.tp=2"],
    "pp x hsdp": [*LM, "parallelism=hsdp", "parallelism.nproc_per_node=8", "parallelism.dp_replicate=2",
                  "parallelism.pp=2"],
}


def refused_by_the_cli(argv: list[str], where: Path, capsys: pytest.CaptureFixture) -> str:
    """The CLI's checks before any worker starts, in this process: its stderr, asserted to be one `error:`
    line with exit 2 and nothing made under `where` (the working directory: outputs/ would be there)."""
    from runner.cli import launch
    from runner.cli.preflight import expand_accum, fail, preflight
    from tests.conftest import compose_spec

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        preflight(expand_accum(argv))
        # preflight passed: what the model decides, as launch_workers checks it before it starts a worker
        spec = compose_spec(expand_accum([a for a in argv if not a.startswith(("hydra.", "tracking="))]), where / "run")
        try:
            launch.check_parallel(spec)
        except composition.SpecError as error:
            fail(str(error))  # as the entry's main turns it into its line
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert sorted(p.name for p in where.iterdir()) == ["resume"], "the refused command made " + str(list(where.iterdir()))
    return lines[0]


def _argv(feature: str, dim: str, where: Path) -> list[str]:
    keys, _ = FEATURE_KEYS[feature]
    keys = [k.format(resume=where / "resume") for k in keys]
    sweep = ["-m"] if "-m" in keys else []
    data = CNN if feature == "batchnorm" else LM
    run_dir = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    return [*sweep, *[k for k in keys if k != "-m"], *data, *DIMENSION_KEYS[dim], "tracking=none",
            f"{run_dir}={where / 'run'}"]


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory of the command, holding only a checkpoint folder a refused eval names."""
    (tmp_path / "resume").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_refused_cell_has_a_command() -> None:
    assert set(FEATURE_KEYS) == set(composition.FEATURES)
    assert {n for n, _ in composition.PAIRS} == {tuple(p.replace("fsdp", "dp_shard").split(" x ")) if p != "pp x hsdp"
                                                 else ("pp", "dp_replicate", "dp_shard") for p in PAIRS}


@pytest.mark.parametrize("feature, dim", REFUSED, ids=[f"{f}-{d}" for f, d in REFUSED])
def test_a_refused_cell_is_one_line_exit_2_before_anything_exists(feature: str, dim: str, where: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    line = refused_by_the_cli(_argv(feature, dim, where), where, capsys)
    cell = composition.TABLE[feature][dim]
    if (feature, dim) in FIRST_REFUSED_ELSEWHERE:
        assert FIRST_REFUSED_ELSEWHERE[feature, dim] in line, line
        return
    assert FEATURE_KEYS[feature][1] in line and DIMENSION_SHOWN[dim] in line, line
    assert cell.why in line, line


# cells whose command an earlier check refuses in its own words, before the table's is asked
FIRST_REFUSED_ELSEWHERE = {
    # on this CPU machine the launcher refuses cp itself first (test_batchnorm_under_cp_is_refused_by_the_table)
    ("batchnorm", "cp"): "error: parallelism.cp: 2, but context parallelism needs CUDA",
}


def test_batchnorm_under_cp_is_refused_by_the_table(tmp_path: Path) -> None:
    """Where cp can run (CUDA), the BatchNorm cell's line is the launcher's, on the model built on the meta device."""
    import torch

    from runner.engine.run_data import build_data
    from runner.engine import components
    from tests.conftest import compose_spec

    spec = compose_spec([*CNN, "parallelism.cp=2"], tmp_path / "run")
    data = build_data(spec)
    with torch.device("meta"):
        model = components.build_model(spec, data)
    with pytest.raises(composition.SpecError) as e:
        composition.check_model(spec, model)
    assert str(e.value).startswith("model: runner.models.cnn.CNN's BatchNorm layer") and "parallelism.cp=2" in str(e.value)
    assert composition.TABLE["batchnorm"]["cp"].why in str(e.value)


@pytest.mark.parametrize("pair", list(PAIRS))
def test_dimensions_that_do_not_combine_are_one_line_exit_2_before_anything_exists(pair: str, where: Path,
                                                                                   capsys: pytest.CaptureFixture) -> None:
    line = refused_by_the_cli([*PAIRS[pair], "tracking=none", f"hydra.run.dir={where / 'run'}"], where, capsys)
    assert f"{pair} is not built yet" in line, line
