"""The study loop on a tiny app (no training): slots, faults, resume, sharing, heartbeats."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from runner.trial import open_storage

APP = '''
import os, time
from pathlib import Path
import hydra


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg) -> float:
    n, marks = cfg.trial.number, Path(cfg.marks)
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{n}-{os.getpid()}").touch()
    while (marks / "hang").exists():
        time.sleep(0.1)
    if n == cfg.kill_trial and not (marks / "killed").exists():
        (marks / "killed").touch()
        os.kill(os.getpid(), 9)
    time.sleep(cfg.sleep_first if n == 0 else cfg.sleep)
    if cfg.x == "fail":
        raise RuntimeError("this trial fails")
    return float("nan") if cfg.x == "nanvalue" else float(cfg.x)


if __name__ == "__main__":
    main()
'''
CONFIG = '''
defaults:
  - override hydra/sweeper: optuna

x: 1
sleep: 0.0
sleep_first: 0.0
kill_trial: -1
marks: marks
trial:
  storage: null
  study_name: null
  number: null

hydra:
  sweeper:
    study_name: mechanics
    storage: study.journal
    n_trials: 3
    params:
      x: range(0, 100)
'''


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(CONFIG)
    return tmp_path


def sweep(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "app.py", "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def trials(cwd: Path, name: str = "mechanics") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=open_storage(str(cwd / "study.journal"))).trials


def states(cwd: Path, name: str = "mechanics") -> list[str]:
    return [t.state.name for t in trials(cwd, name)]


def test_slots_refill_as_trials_end_and_a_killed_job_is_retried(app: Path) -> None:
    sweep(app, "hydra.sweeper.n_jobs=2", "hydra.sweeper.max_retry=1", "sleep_first=5", "sleep=0.2", "kill_trial=1")
    t = trials(app)
    # trial 1's process killed itself: FAIL, and its retry (same params) took its place in the budget
    assert [x.state.name for x in t] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert t[2].system_attrs["failed_trial"] == 1 and t[2].params == t[1].params
    # no batch barrier: trials 2 and 3 started while trial 0 (5 s) still ran in the other slot
    assert t[2].datetime_start < t[0].datetime_complete and t[3].datetime_start < t[0].datetime_complete
    pids = {p.name.split("-")[1] for p in (app / "marks").glob("*-*")}
    assert len(pids) == 4  # a process per job


def test_failed_and_nan_trials_fail_and_the_sweep_goes_on(app: Path) -> None:
    args = ["hydra/sweeper/sampler=grid", "x=choice(1, fail, nanvalue)"]
    sweep(app, *args, "hydra.sweeper.max_failure_rate=0.7")
    assert sorted(states(app)) == ["COMPLETE", "FAIL", "FAIL"]
    proc = sweep(app, *args, "hydra.sweeper.study_name=strict", "hydra.sweeper.max_failure_rate=0", check=False)
    assert proc.returncode != 0 and "max_failure_rate=0" in proc.stderr
    assert states(app, "strict").count("FAIL") == 1


def test_rerunning_resumes_the_study_up_to_n_trials_in_total(app: Path) -> None:
    sweep(app, "hydra.sweeper.n_trials=2")
    sweep(app, "hydra.sweeper.n_trials=2")
    assert states(app) == ["COMPLETE"] * 2
    sweep(app, "hydra.sweeper.n_trials=3")
    assert states(app) == ["COMPLETE"] * 3
    assert len({t.params["x"] for t in trials(app)}) == 3  # the resumed sampler does not replay the first draws


def test_two_sweep_processes_share_one_study(app: Path) -> None:
    cmd = [sys.executable, "app.py", "-m", "hydra.sweeper.n_trials=6", "sleep=0.3"]
    procs = [subprocess.Popen(cmd, cwd=app, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outputs]
    run = [t for t in trials(app) if not t.system_attrs.get("runner.surplus")]
    assert [t.state for t in run] == [TrialState.COMPLETE] * 6
    ran = sorted(int(p.name.split("-")[0]) for p in (app / "marks").glob("*-*"))
    assert ran == [t.number for t in run]  # every trial ran exactly once
    assert len({p.name.split("-")[1] for p in (app / "marks").glob("*-*")}) == 2  # both sweeps took trials


def test_a_killed_sweep_leaves_a_stale_trial_that_the_next_sweep_fails_and_retries(app: Path) -> None:
    (app / "marks").mkdir()
    (app / "marks" / "hang").touch()
    args = ["hydra.sweeper.n_trials=1", "hydra.sweeper.heartbeat_interval=1", "hydra.sweeper.max_retry=1"]
    proc = subprocess.Popen([sys.executable, "app.py", "-m", *args], cwd=app, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not list((app / "marks").glob("0-*")) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert states(app) == ["RUNNING"]
    (app / "marks" / "hang").unlink()
    sweep(app, *args)
    t = trials(app)
    assert [x.state for x in t] == [TrialState.FAIL, TrialState.COMPLETE]
    assert t[1].system_attrs["failed_trial"] == 0 and t[1].params == t[0].params
