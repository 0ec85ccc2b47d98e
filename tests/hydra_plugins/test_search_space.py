"""Hydra's override grammar -> Optuna distributions, and every sampler and pruner config builds."""
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hydra_plugins.runner_optuna_sweeper._builders import build_sampler
from hydra_plugins.runner_optuna_sweeper._search_space import distribution_from_config, grid_values, parse_params
from hydra_plugins.runner_optuna_sweeper.hook import SweepConfigError
from runner.specs.registry import CONF_DIR
from runner.search.trial import storage_url


def space(override: str):
    found, fixed, _ = parse_params([override])
    return found.get(override.split("=")[0], fixed.get(override.split("=")[0]))


@pytest.mark.parametrize("override, expected", [
    ("x=choice(sgd, adam)", CategoricalDistribution(["sgd", "adam"])),
    ("x=choice(-5 ,0 ,5)", CategoricalDistribution([-5, 0, 5])),
    ("x=range(1, 3)", IntDistribution(1, 3)),                      # the stop is included, as hydra-optuna-sweeper reads it
    ("x=range(4)", IntDistribution(0, 4)),
    ("x=range(0, 10, step=3)", IntDistribution(0, 9, step=3)),     # 10 is not on the steps: 9 is the last value
    ("x=range(5, 0, -1)", IntDistribution(0, 5)),
    ("x=range(5, 0, -2)", IntDistribution(1, 5, step=2)),          # 5, 3, 1
    ("x=range(-5.5, 5.5, step=0.5)", FloatDistribution(-5.5, 5.5, step=0.5)),
    ("x=range(0, 1, step=0.1)", FloatDistribution(0.0, 1.0, step=0.1)),
    ("x=interval(0, 1)", FloatDistribution(0.0, 1.0)),
    ("x=int(interval(1, 10))", IntDistribution(1, 10)),
    ("x=tag(log, interval(1e-4, 1e-1))", FloatDistribution(1e-4, 1e-1, log=True)),
    ("x=int(tag(log, interval(1, 1024)))", IntDistribution(1, 1024, log=True)),
    ("x=7", "7"),
])
def test_overrides_become_distributions(override: str, expected: object) -> None:
    assert space(override) == expected


def test_range_values_reach_the_stop_with_every_sampler() -> None:
    """range(1, 3) offers 3: a sampler over it draws 1, 2 and 3, and so does the grid."""
    d = space("x=range(1, 3)")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = {study.ask({"x": d}).params["x"] for _ in range(60)}
    assert drawn == {1, 2, 3}
    floats = space("x=range(-5.5, 5.5, step=0.5)")
    assert grid_values("x", floats)[-1] == 5.5 and len(grid_values("x", floats)) == 23
    with pytest.raises(ValueError, match=r"range\(3, 1\) is empty"):
        space("x=range(3, 1)")


def test_shuffled_range_is_a_choice_and_later_overrides_win() -> None:
    assert sorted(space("x=shuffle(range(1, 4))").choices) == [1, 2, 3, 4]
    found, fixed, _ = parse_params(["lr=interval(0, 1)", "bs=choice(1, 2)", "lr=0.1"])
    assert found == {"bs": CategoricalDistribution([1, 2])} and fixed == {"lr": "0.1"}


@pytest.mark.parametrize("param, message", [
    ("lr=interval(1, 0.1)", "hydra.sweeper.params.lr: interval(1, 0.1): its low 1.0 is above its high 0.1; allowed: "
                            "interval(low, high) with low <= high"),
    ("lr=tag(log, interval(0, 1))", "hydra.sweeper.params.lr: tag(log, interval(0, 1)): a log scale needs low > 0, got 0.0"),
    ("lr=tag(logg, interval(0.1, 1))", "hydra.sweeper.params.lr: tag(logg, interval(0.1, 1)): unknown tag 'logg'; allowed: "
                                       "log, as in tag(log, interval(low, high))"),
    ("bs=tag(log, range(1, 8))", "hydra.sweeper.params.bs: tag(log, range(1, 8)): tag(log, ...) applies to an interval "
                                 "only; allowed: tag(log, interval(low, high))"),
    ("bs=range(5, 1)", "hydra.sweeper.params.bs: range(5, 1) is empty (a step of 1 never goes from 5 to 1); allowed: "
                       "range(start, stop) with start <= stop, or a negative step to count down"),
])
def test_a_search_space_the_sampler_cannot_take_as_written_is_one_line_naming_the_key(param: str, message: str) -> None:
    """Refused, not sampled otherwise: a misspelt log tag sampled on a linear scale before."""
    with pytest.raises(SweepConfigError) as e:
        parse_params([param], ["hydra.sweeper.params."])
    assert str(e.value) == message


def test_grid_values_include_both_ends_of_the_distribution() -> None:
    assert grid_values("x", space("x=range(-1, 1, step=0.5)")) == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert grid_values("x", space("x=range(0, 10, step=3)")) == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="grid sampler needs discrete values"):
        grid_values("x", space("x=interval(0, 1)"))


def test_the_deprecated_search_space_form_still_reads() -> None:
    assert distribution_from_config({"type": "float", "low": -5.5, "high": 5.5, "step": 0.5}) == FloatDistribution(-5.5, 5.5, step=0.5)
    assert distribution_from_config({"type": "int", "low": 1, "high": 64, "log": True}) == IntDistribution(1, 64, log=True)
    assert distribution_from_config({"type": "categorical", "choices": [-5, 0, 5]}) == CategoricalDistribution([-5, 0, 5])


def sweeper_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["hparams_search=digits_optuna", *overrides], return_hydra_config=True).hydra.sweeper


SAMPLERS = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
            "cmaes": optuna.samplers.CmaEsSampler, "nsgaii": optuna.samplers.NSGAIISampler,
            "gp": optuna.samplers.GPSampler, "qmc": optuna.samplers.QMCSampler}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_every_sampler_config_builds_its_sampler(name: str) -> None:
    cfg = sweeper_config(f"hydra/sweeper/sampler={name}", "hydra.sweeper.sampler.seed=3")
    assert isinstance(build_sampler(cfg.sampler), SAMPLERS[name])
    grid = build_sampler(sweeper_config("hydra/sweeper/sampler=grid").sampler, {"x": [1, 2]})
    assert isinstance(grid, optuna.samplers.GridSampler)


PRUNERS = {"none": optuna.pruners.NopPruner, "median": optuna.pruners.MedianPruner,
           "percentile": optuna.pruners.PercentilePruner, "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
           "hyperband": optuna.pruners.HyperbandPruner}


@pytest.mark.parametrize("name", sorted(PRUNERS))
def test_every_pruner_config_builds_its_pruner(name: str) -> None:
    cfg = sweeper_config(f"hydra/sweeper/pruner={name}")
    assert isinstance(instantiate(OmegaConf.to_container(cfg.pruner, resolve=True)), PRUNERS[name])


def test_the_study_config_reads_its_direction_from_the_objective() -> None:
    cfg = sweeper_config("objective.direction=minimize", "hydra.sweeper.params.optimizer='choice(sgd)'")
    assert cfg.direction == "minimize" and cfg.study_name == "digits_optuna" and cfg.params.optimizer == "choice(sgd)"


def test_storage_urls_are_absolute_so_every_job_opens_the_same_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert storage_url("study.journal") == str(tmp_path / "study.journal")
    assert storage_url("sqlite:///s.db") == f"sqlite:///{tmp_path}/s.db"
    assert storage_url("postgresql://u:p@db/optuna") == "postgresql://u:p@db/optuna"


def test_the_sweeper_imports_neither_runner_nor_torch() -> None:
    """DESIGN: the sweeper is its own package; runner plugs in through the hook its task function declares."""
    code = ("import sys; sys.modules.update(runner=None, torch=None); "
            "import hydra_plugins.runner_optuna_sweeper._impl, hydra_plugins.runner_optuna_sweeper.optuna_sweeper; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('runner', 'torch', 'mlflow') and sys.modules[m]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-3000:]
