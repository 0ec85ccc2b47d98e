"""What a seeded sweep reproduces, as README.md and sweeper/README.md say: their sphere command (n_jobs=1)
gives the values they print, at every run; with n_jobs=2 every trial's params are drawn in the sweep's own
thread in trial-number order (issue 24, defect 9: slot threads drew them in whatever order they ran), so a
sampler that does not learn from results (random) gives each trial the same params as with n_jobs=1, and
TPE's 10 startup trials (0 to 9) are the same in every run (a later trial depends on which trials had
finished when it was asked)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from hydra_plugins.runner_optuna_sweeper.storage import open_storage

REPO = Path(__file__).resolve().parents[2]
SPHERE = '''
import hydra
from omegaconf import DictConfig

@hydra.main(version_base=None, config_path=None)
def sphere(cfg: DictConfig) -> float:
    return cfg.x ** 2 + cfg.y ** 2

if __name__ == "__main__":
    sphere()
'''
RECORDING = '''
import json, os, threading, time
from optuna.samplers import RandomSampler

class Recording(RandomSampler):
    """Random sampling that notes which thread drew each param and dawdles after each draw (as a storage
    round trip does), so that slot threads drawing at once would interleave."""

    def sample_independent(self, study, trial, name, distribution):
        value = super().sample_independent(study, trial, name, distribution)
        with open(os.environ["DRAWS"], "a") as f:
            f.write(json.dumps([trial.number, name, threading.current_thread().name]) + "\\n")
        time.sleep(0.05)
        return value
'''


def documented() -> tuple[list[str], str, str]:
    """sweeper/README.md's command's arguments and the parameters and value it prints."""
    text = (REPO / "sweeper" / "README.md").read_text()
    command = re.search(r"python sphere\.py -m (.+?)\\\n\s+(.+?)\n", text)
    args = re.findall(r"'[^']*'|\S+", command.group(1) + " " + command.group(2))
    params = re.search(r"\[HYDRA\] Best parameters: (.+)\n", text).group(1)
    value = re.search(r"\[HYDRA\] Best value: (.+)\n", text).group(1)
    return [a.strip("'") for a in args], params, value


def run(tmp_path: Path, name: str, args: list[str]) -> tuple[str, list[dict]]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "sweeper"), "DRAWS": str(tmp_path / f"{name}.draws")}
    proc = subprocess.run([sys.executable, "sphere.py", "-m", *args, f"hydra.sweep.dir={tmp_path / name}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    storage = open_storage(str(tmp_path / name / "optuna.journal"))
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    return proc.stdout + proc.stderr, [t.params for t in study.trials]


@pytest.mark.slow
def test_the_documented_seeded_sweep_prints_the_documented_values_and_n_jobs_2_repeats_its_first_10_trials(
        tmp_path: Path) -> None:
    (tmp_path / "sphere.py").write_text(SPHERE)
    args, params, value = documented()
    assert "hydra.sweeper.n_jobs=1" in args and "hydra.sweeper.sampler.seed=0" in args
    for i in range(2):
        out, _ = run(tmp_path, f"one{i}", args)
        assert f"Best parameters: {params}" in out and f"Best value: {value}" in out
    _, sequential = run(tmp_path, "seq", args)
    parallel = [run(tmp_path, f"two{i}", [a.replace("n_jobs=1", "n_jobs=2") for a in args])[1] for i in range(2)]
    assert parallel[0][:10] == parallel[1][:10] == sequential[:10]  # TPE's startup trials
    readme = (REPO / "README.md").read_text()
    assert f"Best parameters: {params}   Best value: {value}" in readme  # README prints the same command's values


def test_a_seeded_random_sweep_with_n_jobs_2_draws_in_trial_order_in_the_sweeps_thread_as_with_n_jobs_1(
        tmp_path: Path) -> None:
    (tmp_path / "sphere.py").write_text(RECORDING + SPHERE)
    _, params = run(tmp_path, "two", ["hydra/sweeper=runner_optuna", "hydra/sweeper/sampler=random",
                                      "hydra.sweeper.sampler._target_=__main__.Recording", "hydra.sweeper.n_trials=6",
                                      "hydra.sweeper.n_jobs=2", "hydra.sweeper.sampler.seed=0",
                                      "+x=interval(-5, 5)", "+y=range(-5, 5)"])
    draws = [json.loads(line) for line in (tmp_path / "two.draws").read_text().splitlines()]
    assert {thread for _, _, thread in draws} == {"MainThread"}
    assert [(number, name) for number, name, _ in draws] == [(n, k) for n in range(6) for k in ("+x", "+y")]
    alone = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    expected = []
    for _ in range(6):  # the same seed drawing trial after trial in one thread: n_jobs=1
        trial = alone.ask()
        expected.append({"+x": trial.suggest_float("+x", -5, 5), "+y": trial.suggest_int("+y", -5, 5)})
    assert params == expected
