"""Short trials as cheap as long ones: a slot's process runs trial after trial (yet each trial starts
as in a new process), and trials that pick the same config groups share one composition."""
import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf

from hydra_plugins.runner_optuna_sweeper._compose_cache import CachingConfigLoader
from runner.specs import registry
from tests.hydra_plugins.test_sweep_mechanics import states

APP = '''
import json, os, random
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg) -> float:
    n = HydraConfig.get().job.num
    seen = {"n": n, "pid": os.getpid(), "leak": os.environ.get("LEAK"), "random": random.random(),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
    Path(f"{cfg.marks}/{n}.json").write_text(json.dumps(seen))
    os.environ["LEAK"] = str(n)  # what a trial leaves behind must not reach the next one
    random.seed(0)
    if n == cfg.fail_trial:
        raise RuntimeError("this trial fails")
    return float(cfg.x)


if __name__ == "__main__":
    main()
'''
CONFIG = '''
defaults:
  - override hydra/sweeper: optuna
x: 1
fail_trial: -1
marks: ???
hydra:
  sweeper:
    study_name: mechanics
    storage: study.journal
    n_trials: 7
    n_jobs: 2
    max_failure_rate: 1.0
    params:
      x: range(0, 100)
'''
SEEDED = 0.8444218515250481  # random.random() right after random.seed(0)


def test_a_slot_process_runs_trial_after_trial_each_as_in_a_new_process(tmp_path: Path) -> None:
    app, marks = tmp_path / "app", tmp_path / "marks"  # marks/ beside config.yaml would read as a config group
    app.mkdir()
    marks.mkdir()
    (app / "app.py").write_text(APP)
    (app / "config.yaml").write_text(CONFIG)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5"}
    proc = subprocess.run([sys.executable, "app.py", "-m", f"marks={marks}", "fail_trial=2"], cwd=app,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(states(app)) == ["COMPLETE"] * 6 + ["FAIL"]
    seen = [json.loads((marks / f"{n}.json").read_text()) for n in range(7)]
    by_pid: dict[int, list[dict]] = {}
    for s in seen:
        by_pid.setdefault(s["pid"], []).append(s)
    # 7 trials in 2 slots: processes are reused, and the failed trial's process was replaced
    assert len(by_pid) == 3 and max(len(v) for v in by_pid.values()) >= 2
    failed_pid = seen[2]["pid"]
    assert all(s["n"] <= 2 for s in by_pid[failed_pid])
    for s in seen:  # each trial starts with the sweep's environment and a fresh random seed
        assert s["leak"] is None and s["random"] != SEEDED
    # each process keeps its slot's GPU, and the two slots have different ones
    assert all(len({s["cuda"] for s in trials}) == 1 for trials in by_pid.values())
    assert {s["cuda"] for s in seen} == {"3", "5"}


def test_trials_picking_the_same_groups_share_one_composition_equal_to_hydras() -> None:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(registry.CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        master = loader.load_configuration("config", ["hparams_search=digits_optuna"], run_mode=RunMode.MULTIRUN)
        cache = CachingConfigLoader(loader)
        trials = [["optimizer=adam", "optimizer.lr=0.01", "dataset.batch_size=32", "trial.number=0"],
                  ["optimizer=adam", "optimizer.lr=0.02", "dataset.batch_size=64", "trial.number=1"],
                  ["optimizer=sgd", "optimizer.lr=0.03", "dataset.batch_size=64", "trial.number=2"],
                  ["optimizer=adam", "optimizer.lr=0.04", "dataset.batch_size=128", "+trainer.extra=1"],
                  ["optimizer=adam", "optimizer.lr=0.05", "dataset.batch_size=128", "+trainer.extra=2"]]
        composed = []
        for overrides in trials:
            overrides = ["hparams_search=digits_optuna", *overrides]
            got = cache.load_sweep_config(master, overrides)
            want = loader.load_sweep_config(master, overrides)
            assert OmegaConf.to_container(got) == OmegaConf.to_container(want)
            assert got.hydra.job.override_dirname == want.hydra.job.override_dirname
            composed.append(cache.composed)
    GlobalHydra.instance().clear()
    # a new group set is composed once (adam, sgd), twice where a + override could be a group (checked
    # against Hydra), the same set again not at all
    assert composed == [1, 1, 2, 4, 4]
