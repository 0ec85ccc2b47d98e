"""hydra-optuna-sweeper's documented examples run unchanged on this sweeper (same sweeper name)."""
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
import yaml

from runner.trial import open_storage

# hydra-optuna-sweeper's example/sphere.py and example/conf/config.yaml, as its docs show them
SPHERE = '''
import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def sphere(cfg: DictConfig) -> float:
    x: float = cfg.x
    y: float = cfg.y
    return x**2 + y**2


if __name__ == "__main__":
    sphere()
'''
EXAMPLE = '''
defaults:
  - override hydra/sweeper: optuna

hydra:
  sweeper:
    sampler:
      seed: 123
    direction: minimize
    study_name: sphere
    storage: null
    n_trials: 20
    n_jobs: 1
    params:
      x: range(-5.5, 5.5, step=0.5)
      y: choice(-5 ,0 ,5)

x: 1
y: 1
z: 1
'''
# its custom-search-space example
CUSTOM_APP = '''
import hydra
from omegaconf import DictConfig
from optuna.trial import Trial


@hydra.main(version_base=None, config_path="custom-search-space", config_name="config")
def multi_dimensional_sphere(cfg: DictConfig) -> float:
    w: float = cfg.w
    x: float = cfg.x
    y: float = cfg.y
    z: float = cfg.z
    return w**2 + x**2 + y**2 + z**2


def configure(cfg: DictConfig, trial: Trial) -> None:
    x_value = trial.params["x"]
    trial.suggest_float(
        "z",
        x_value - cfg.max_z_difference_from_x,
        x_value + cfg.max_z_difference_from_x,
    )
    trial.suggest_float("+w", 0.0, 1.0)  # note +w here, not w as w is a new parameter


if __name__ == "__main__":
    multi_dimensional_sphere()
'''
CUSTOM = '''
defaults:
  - override hydra/sweeper: optuna

hydra:
  sweeper:
    sampler:
      seed: 123
    direction: minimize
    study_name: custom-search-space
    storage: null
    n_trials: 20
    n_jobs: 1

    params:
      x: range(-5.5, 5.5, 0.5)
      y: choice(-5, 0, 5)
    # `custom_search_space` should be a dotpath pointing to a
    # callable that provides search-space configuration logic:
    custom_search_space: custom_search_space_objective.configure

x: 1
y: 1
z: 100
max_z_difference_from_x: 0.5
'''
X_VALUES = [-5.5 + 0.5 * i for i in range(22)]  # range(-5.5, 5.5, step=0.5): 5.5 itself excluded


def run_app(cwd: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, script, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def study(cwd: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(str(cwd / "outputs" / "optuna.journal")))


def results(cwd: Path) -> dict:
    (path,) = cwd.glob("multirun/*/*/optimization_results.yaml")
    return yaml.safe_load(path.read_text())


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())


def test_sphere_example_runs_unchanged(tmp_path: Path) -> None:
    write(tmp_path / "sphere.py", SPHERE)
    write(tmp_path / "conf" / "config.yaml", EXAMPLE)
    run_app(tmp_path, "sphere.py")
    trials = study(tmp_path, "sphere").trials
    assert len(trials) == 20 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert {t.params["x"] for t in trials} <= set(X_VALUES) and {t.params["y"] for t in trials} <= {-5, 0, 5}
    best = results(tmp_path)
    assert best["name"] == "optuna" and best["best_value"] == min(t.value for t in trials)
    assert best["best_value"] == best["best_params"]["x"] ** 2 + best["best_params"]["y"] ** 2


def test_sphere_example_with_grid_sampler_and_command_line_space(tmp_path: Path) -> None:
    write(tmp_path / "sphere.py", SPHERE)
    write(tmp_path / "conf" / "config.yaml", EXAMPLE.replace("    sampler:\n      seed: 123\n", ""))
    # the grid of range(-1, 1, step=0.5) x choice(-5, 0, 5) has 4 x 3 points: n_trials is capped at 12
    run_app(tmp_path, "sphere.py", "hydra/sweeper/sampler=grid", "x=range(-1, 1, step=0.5)")
    trials = study(tmp_path, "sphere").trials
    points = {(t.params["x"], t.params["y"]) for t in trials}
    assert len(trials) == 12 and points == {(x, y) for x in (-1.0, -0.5, 0.0, 0.5) for y in (-5, 0, 5)}
    assert results(tmp_path)["best_value"] == 0.0


def test_custom_search_space_example(tmp_path: Path) -> None:
    write(tmp_path / "custom_search_space_objective.py", CUSTOM_APP)
    write(tmp_path / "custom-search-space" / "config.yaml", CUSTOM)
    run_app(tmp_path, "custom_search_space_objective.py", "hydra.sweeper.n_trials=5", "x=int(interval(-3, 3))",
            "y=tag(log, interval(1, 10))")
    trials = study(tmp_path, "custom-search-space").trials
    assert len(trials) == 5
    for t in trials:
        assert isinstance(t.params["x"], int) and -3 <= t.params["x"] <= 3 and 1 <= t.params["y"] <= 10
        assert abs(t.params["z"] - t.params["x"]) <= 0.5 and 0 <= t.params["+w"] <= 1
        assert t.value == pytest.approx(sum(t.params[k] ** 2 for k in ("x", "y", "z", "+w")))


# its multi-objective example
MULTI_APP = '''
from typing import Tuple

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="multi-objective-conf", config_name="config")
def binh_and_korn(cfg: DictConfig) -> Tuple[float, float]:
    x: float = cfg.x
    y: float = cfg.y

    v0 = 4 * x**2 + 4 * y**2
    v1 = (x - 5) ** 2 + (y - 5) ** 2
    return v0, v1


if __name__ == "__main__":
    binh_and_korn()
'''
MULTI = '''
defaults:
  - override hydra/sweeper: optuna
  - override hydra/sweeper/sampler: nsgaii

hydra:
  sweeper:
    sampler:
      seed: 123
    direction: [minimize, minimize]
    study_name: multi-objective
    storage: null
    n_trials: 20
    n_jobs: 1
    params:
      x: range(0, 5, step=0.5)
      y: range(0, 3, step=0.5)

x: 1
y: 1
'''


def test_multi_objective_example(tmp_path: Path) -> None:
    write(tmp_path / "multi-objective.py", MULTI_APP)
    write(tmp_path / "multi-objective-conf" / "config.yaml", MULTI)
    run_app(tmp_path, "multi-objective.py")
    trials = study(tmp_path, "multi-objective").trials
    assert len(trials) == 20 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for t in trials:
        x, y = t.params["x"], t.params["y"]
        assert x < 5 and y < 3 and t.values == [4 * x**2 + 4 * y**2, (x - 5) ** 2 + (y - 5) ** 2]
    front = results(tmp_path)["solutions"]
    assert front and all(len(s["values"]) == 2 for s in front)
