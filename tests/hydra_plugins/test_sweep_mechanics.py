"""The study loop on a tiny app (no training): slots, faults, resume, sharing, heartbeats."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

import optuna
import pytest
from optuna.trial import TrialState

from runner.search.trial import open_storage
from tests.process_tree import alive, descendants

APP = '''
import os, time
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg) -> float:
    n, marks = HydraConfig.get().job.num, Path(cfg.marks)  # the sweeper launches trial N as job N
    marks.mkdir(parents=True, exist_ok=True)
    (marks / f"{n}-{os.getpid()}").touch()
    while (marks / "hang").exists():
        time.sleep(0.1)
    if n == cfg.kill_trial and not (marks / "killed").exists():
        (marks / "killed").touch()
        os.kill(os.getpid(), 9)
    if n == 0 and cfg.wait_for:  # trial 0 runs until the trials it waits for have started (events, not clocks)
        deadline = time.time() + 120  # a bound for "never", should the slots not refill
        while not all(any(marks.glob(f"{k}-*")) for k in cfg.wait_for) and time.time() < deadline:
            time.sleep(0.05)
        if all(any(marks.glob(f"{k}-*")) for k in cfg.wait_for):
            (marks / ("0-saw-" + ",".join(map(str, cfg.wait_for)))).touch()
    time.sleep(cfg.sleep)
    if cfg.x == "fail":
        raise RuntimeError("this trial fails")
    return float("nan") if cfg.x == "nanvalue" else float(cfg.x)


if __name__ == "__main__":
    main()
'''
CONFIG = '''
defaults:
  - override hydra/sweeper: runner_optuna

x: 1
sleep: 0.0
wait_for: []
kill_trial: -1
marks: marks

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
    sweep(app, "hydra.sweeper.n_jobs=2", "hydra.sweeper.max_retry=1", "wait_for=[2,3]", "sleep=0.2", "kill_trial=1")
    t = trials(app)
    # trial 1's process killed itself: FAIL, and its retry (same params) took its place in the budget
    assert [x.state.name for x in t] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert t[2].system_attrs["failed_trial"] == 1 and t[2].params == t[1].params
    # no batch barrier: trials 2 and 3 started while trial 0 still ran in the other slot (it waited to see them;
    # before, the test compared the trials' clock times, and a loaded machine's 1.4 ms decided it)
    assert (app / "marks" / "0-saw-2,3").exists()
    pid = {int(p.name.split("-")[0]): p.name.split("-")[1] for p in (app / "marks").glob("*-*") if "saw" not in p.name}
    # a slot's process runs trial after trial; the killed one's slot got a new process for trials 2 and 3
    assert pid[2] == pid[3] and len({pid[0], pid[1], pid[2]}) == 3


def test_failed_and_nan_trials_fail_and_the_sweep_goes_on_up_to_max_failure_rate(app: Path) -> None:
    args = ["hydra/sweeper/sampler=grid", "x=choice(1, fail, nanvalue)"]
    sweep(app, *args, "hydra.sweeper.max_failure_rate=0.7")
    assert sorted(states(app)) == ["COMPLETE", "FAIL", "FAIL"]
    # the default, as in hydra-optuna-sweeper, is 0.0: the first failure stops the sweep, non-zero
    proc = sweep(app, *args, "hydra.sweeper.study_name=strict", check=False)
    assert proc.returncode == 1 and "max_failure_rate=0.0" in proc.stderr
    assert states(app, "strict").count("FAIL") == 1


def test_a_failed_trial_is_one_console_line_and_its_traceback_is_in_its_job_log(app: Path) -> None:
    proc = sweep(app, "hydra.sweeper.n_trials=1", "x=fail", check=False)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in console
    (failed,) = [line for line in console.splitlines() if "trial 0 failed" in line]
    assert "RuntimeError: this trial fails" in failed
    (job_log,) = app.glob("multirun/*/*/0/app.log")
    assert failed.endswith(f"(traceback in {job_log})")
    text = job_log.read_text()
    assert "Traceback (most recent call last)" in text and 'raise RuntimeError("this trial fails")' in text


def test_a_sweep_in_which_every_trial_failed_exits_non_zero(app: Path) -> None:
    proc = sweep(app, "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", "hydra.sweeper.max_failure_rate=1.0",
                 "x=fail", check=False)
    assert states(app) == ["FAIL", "FAIL"]
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: all 2 trials this sweep ran failed")
    (job_log,) = app.glob("multirun/*/*/1/app.log")  # in a slot process too, the traceback reaches the job log
    assert "RuntimeError: this trial fails" in job_log.read_text()


def test_a_named_storage_resumes_the_study_up_to_n_trials_in_total(app: Path) -> None:
    sweep(app, "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=3", "x=interval(0.0, 100.0)")
    sweep(app, "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=3", "x=interval(0.0, 100.0)")
    assert states(app) == ["COMPLETE"] * 2
    sweep(app, "hydra.sweeper.n_trials=4", "hydra.sweeper.sampler.seed=3", "x=interval(0.0, 100.0)")
    assert states(app) == ["COMPLETE"] * 4
    assert len({t.params["x"] for t in trials(app)}) == 4  # the resumed sampler does not replay the first draws


@pytest.mark.parametrize("change, message", [
    (["x=interval(0.0, 100.0)"], "error: hydra.sweeper.params: the search space differs from study 'mechanics' in {storage}: "
                             "x was int [0, 100], is now float [0, 100]; resume it with its own search space, or start "
                             "a new study (another study_name)"),
    (["y=choice(1, 2)"], "error: hydra.sweeper.params: the search space differs from study 'mechanics' in {storage}: "
                         "y is new; resume it with its own search space, or start a new study (another study_name)"),
    (["hydra.sweeper.direction=maximize"], "error: hydra.sweeper.direction: study 'mechanics' in {storage} was created "
                                           "to minimize, this sweep asks to maximize; resume it with its own direction, "
                                           "or start a new study (another study_name)"),
])
def test_a_resume_that_changes_the_search_space_or_direction_stops_with_one_line(app: Path, change: list, message: str) -> None:
    sweep(app, "hydra.sweeper.n_trials=1")
    proc = sweep(app, "hydra.sweeper.n_trials=2", *change, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [message.format(storage=app / "study.journal")]
    assert states(app) == ["COMPLETE"]  # nothing ran


def test_storage_null_runs_a_new_study_at_every_rerun(app: Path) -> None:
    """hydra-optuna-sweeper's `storage: null` is a new (in-memory) study per sweep: rerunning a
    command runs n_trials again, even under the same study_name."""
    for rerun in range(2):  # Hydra's default sweep dir has a one-second clock: two quick reruns would share it
        sweep(app, "hydra.sweeper.storage=null", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={app}/multirun/rerun/{rerun}")
    journals = sorted(app.glob("multirun/*/*/optuna.journal"))
    assert len(journals) == 2
    for journal in journals:
        study = optuna.load_study(study_name="mechanics", storage=open_storage(str(journal)))
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
        results = yaml.safe_load((journal.parent / "optimization_results.yaml").read_text())
        assert results["best_value"] == min(t.value for t in study.trials) and results["storage"] == str(journal)
    # a rerun into the same sweep directory would mix two sweeps' jobs: it stops, and says how to resume
    fixed = ["hydra.sweeper.storage=null", "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={app}/fixed"]
    sweep(app, *fixed)
    proc = sweep(app, *fixed, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: hydra.sweeper.storage: null starts a new study, but this sweep directory ({app}/fixed) already holds "
        f"study 'mechanics' of an earlier sweep; to resume it set hydra.sweeper.storage={app}/fixed/optuna.journal, "
        "else give the sweep a new hydra.sweep.dir"]


def test_an_app_that_sets_no_direction_minimizes(app: Path) -> None:
    sweep(app, "hydra.sweeper.n_trials=1")
    assert optuna.load_study(study_name="mechanics", storage=open_storage(str(app / "study.journal"))).direction.name == "MINIMIZE"


def test_a_pruner_on_an_app_that_never_reports_is_warned_about_once(app: Path) -> None:
    proc = sweep(app, "hydra.sweeper.n_trials=2", "hydra/sweeper/pruner=median")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "prunes nothing" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "the pruner (MedianPruner) prunes nothing in this sweep: trial 0 completed without reporting a value; a job must "
        "call trial.report(value, step) and raise optuna.TrialPruned when trial.should_prune() (sweeper/README.md, "
        "Configuration), else use hydra/sweeper/pruner=none")
    assert states(app) == ["COMPLETE", "COMPLETE"]


@pytest.mark.slow  # CI budget: test_sweep_processes_sharing_a_study_propose_different_trials asserts the same of two
# sweeps started together (every trial run once, both taking trials), with a random sampler
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


# Runs app.py with Study.ask held back until both sweep processes reach their first ask: both have
# set up their samplers by then, as when two sweeps are started at the same moment.
BARRIER = '''
import os, runpy, sys, time
from pathlib import Path
import optuna

ask = optuna.Study.ask


def ask_together(self, *args, **kwargs):
    Path(f"ready-{os.getpid()}").touch()
    while len(list(Path(".").glob("ready-*"))) < 2:
        time.sleep(0.05)
    return ask(self, *args, **kwargs)


optuna.Study.ask = ask_together
sys.argv = ["app.py", *sys.argv[1:]]
runpy.run_path("app.py", run_name="__main__")
'''


def test_sweep_processes_sharing_a_study_propose_different_trials(app: Path) -> None:
    """Both processes configure seed 0; the one that joins the study the other created adds its own
    random number to it."""
    (app / "barrier.py").write_text(BARRIER)
    cmd = [sys.executable, "barrier.py", "-m", "hydra.sweeper.n_trials=8", "hydra/sweeper/sampler=random",
           "hydra.sweeper.sampler.seed=0", "x=interval(0.0, 1.0)", "sleep=0.2"]
    procs = [subprocess.Popen(cmd, cwd=app, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outputs]
    run = [t for t in trials(app) if t.state == TrialState.COMPLETE]
    assert len(run) == 8 and len({t.params["x"] for t in run}) == 8  # no parameter set twice
    assert [t.state for t in trials(app) if not t.system_attrs.get("runner.surplus")] == [TrialState.COMPLETE] * 8
    ran = sorted(int(p.name.split("-")[0]) for p in (app / "marks").glob("*-*"))
    assert ran == sorted(t.number for t in run)  # every trial ran exactly once
    assert len({p.name.split("-")[1] for p in (app / "marks").glob("*-*")}) == 2  # both sweeps took trials


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_trials_die_with_their_sweep_when_it_is_killed(app: Path) -> None:
    (app / "marks").mkdir()
    (app / "marks" / "hang").touch()
    proc = subprocess.Popen([sys.executable, "app.py", "-m", "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=4"],
                            cwd=app, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while len(list((app / "marks").glob("*-*"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        trial_pids = {int(p.name.split("-")[1]) for p in (app / "marks").glob("*-*")}
        assert len(trial_pids) == 2
        below = descendants(proc.pid)
        assert trial_pids <= below
        proc.kill()  # SIGKILL, to the sweep process alone: it can clean nothing up
        proc.wait()
        deadline = time.time() + 8
        while any(alive(p) for p in below) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in below if alive(p)]  # fork server and trials are gone, the hang notwithstanding
    finally:
        (app / "marks" / "hang").unlink()
        for pid in descendants(proc.pid) if proc.poll() is None else ():
            os.kill(pid, signal.SIGKILL)


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
