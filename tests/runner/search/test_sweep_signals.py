"""SIGTERM to an Optuna sweep whose trials run in processes of their own (slot processes with n_jobs=2, or Hydra's
joblib launcher's workers): it stops as on Ctrl-C, its trials stopped at a step boundary, its parent run ended
KILLED, in one line and exit 143 (issue 35 item 12; before, with slot processes the sweep process died on the spot,
no summary, its parent run left RUNNING; under joblib it went on until its trials ended by themselves, then printed
an "Exception ignored" traceback). Order from events: the signal goes once both trials have logged a training
step; the trials are given far more steps than the wait for the sweep's end could see them train."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.process_tree import children_of

NEVER_ENDS = "trainer.max_steps=10000000"  # trials that stop only when stopped


def sweep_command(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "runner", "-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2",
            "hydra.sweeper.n_jobs=2", "hydra/sweeper/pruner=none", NEVER_ENDS, "trainer.log_every_n_steps=1",
            "trainer.progress_bar=off", "trainer.memory_estimate=false", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"tracking.artifact_root={tmp_path / 'art'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]


def both_trials_train(db: Path) -> Callable[[subprocess.Popen], bool]:
    def seen(sweep: subprocess.Popen) -> bool:
        try:
            with sqlite3.connect(db, timeout=1) as con:
                (training,) = con.execute("select count(distinct run_uuid) from metrics where key = 'train/loss'").fetchone()
        except sqlite3.Error:
            return False
        return training == 2
    return seen


def sigterm_once(moment: Callable[[subprocess.Popen], bool], cmd: list[str], cwd: Path) -> tuple[int, str]:
    """(exit code, stderr) of the sweep, sent SIGTERM once `moment` holds."""
    sweep = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.time() + 240  # a bound for "never", not a measure of speed
        while time.time() < deadline and sweep.poll() is None and not moment(sweep):
            time.sleep(0.05)
        assert sweep.poll() is None and moment(sweep), sweep.communicate()[1][-3000:]
        os.kill(sweep.pid, signal.SIGTERM)
        try:
            _, err = sweep.communicate(timeout=240)  # the trials would train for hours: it stopped them
        except subprocess.TimeoutExpired:
            os.killpg(sweep.pid, signal.SIGKILL)
            _, err = sweep.communicate()
            pytest.fail(f"the sweep went on after SIGTERM: {err[-3000:]}")
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    return sweep.returncode, err


def assert_stopped_in_one_line_with_all_runs_killed(code: int, err: str, db: Path) -> None:
    assert code == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "runner: stopped by SIGTERM; the run was marked KILLED", err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    with sqlite3.connect(db, timeout=5) as con:
        statuses = sorted(status for (status,) in con.execute("select status from runs"))
    assert statuses == ["KILLED", "KILLED", "KILLED"]  # the parent run and both trials' runs


def test_a_sigtermed_sweep_with_slot_processes_stops_its_trials_and_ends_killed_in_one_line(tmp_path: Path) -> None:
    code, err = sigterm_once(both_trials_train(tmp_path / "mlflow.db"), sweep_command(tmp_path), tmp_path)
    assert_stopped_in_one_line_with_all_runs_killed(code, err, tmp_path / "mlflow.db")


@pytest.mark.cluster
def test_a_sigtermed_sweep_under_joblib_with_a_sqlite_study_stops_its_trials_and_ends_killed_in_one_line(
        tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="Hydra's joblib launcher is not installed")
    cmd = sweep_command(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                        f"hydra.sweeper.storage=sqlite:///{tmp_path / 'optuna.db'}")
    code, err = sigterm_once(both_trials_train(tmp_path / "mlflow.db"), cmd, tmp_path)
    assert_stopped_in_one_line_with_all_runs_killed(code, err, tmp_path / "mlflow.db")
    import optuna

    study = optuna.load_study(study_name="digits_optuna", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    print([(t.number, t.state.name, t.system_attrs) for t in study.trials])


def test_a_sweep_sigtermed_while_its_slot_processes_start_stops_without_a_traceback(tmp_path: Path) -> None:
    """The slot processes are forked and importing the engine: before, each printed the traceback of the import
    the signal interrupted (about 60 lines a slot)."""
    code, err = sigterm_once(lambda sweep: len(children_of(sweep.pid)) >= 2, sweep_command(tmp_path), tmp_path)
    assert code == 143, err[-3000:]
    assert err.strip().splitlines() == ["runner: stopped by SIGTERM; the run was marked KILLED"], err[-3000:]


@pytest.mark.cluster
def test_a_sweep_under_joblib_sigtermed_as_its_workers_start_stops_them_too(tmp_path: Path) -> None:
    """The signal comes as joblib starts its first worker, before any trial trains: before, the sweep stopped
    its study loop and waited for trials that would train for hours (workers that start after the signal, or
    are starting, never heard of it)."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="Hydra's joblib launcher is not installed")
    cmd = sweep_command(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                        f"hydra.sweeper.storage=sqlite:///{tmp_path / 'optuna.db'}")

    def a_worker_starts(sweep: subprocess.Popen) -> bool:
        for pid in children_of(sweep.pid):
            try:
                if b"LokyProcess" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    code, err = sigterm_once(a_worker_starts, cmd, tmp_path)
    assert code == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "runner: stopped by SIGTERM; the run was marked KILLED", err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]


# --- a trial's run in the sweep's own process (one slot): the signal lands wherever its main thread is -------------

def test_a_signal_as_a_trials_run_finishes_stops_the_sweep_once_the_trial_is_recorded() -> None:
    """The run's handler notes a signal that comes after the run finished (the run stays FINISHED). It used to
    forget it as the job returned, and the sweep ran every trial it had left (seen: SIGTERM to a sweep of 40 short
    trials, exit 0 half a minute later with all 40 FINISHED). Now the sweep's own handler gets it once the sweep has
    recorded the trial with its value: as runner's sweep hook hears the trial is done. Real signals, the sweeper's
    real handler, in this process."""
    from omegaconf import OmegaConf

    from hydra_plugins.runner_optuna_sweeper._stopping import StopSignals, SweepStopped
    from runner.engine import preemption
    from runner.search.sweep_hook import RunnerSweepHook

    stop = StopSignals(raise_now=True, send_on=False)  # the sweep's handler while its trials run in this process
    with stop.installed():
        with preemption.handled():  # the trial's run
            preemption.run_finished()
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler takes it here: the run stays FINISHED
        assert stop.signum == 0  # the job returned normally: the sweeper records the trial's value
        with pytest.raises(SweepStopped):
            RunnerSweepHook(OmegaConf.create({})).trial_done(None, None, killed=False)
    assert stop.signum == signal.SIGTERM


class _SignalledInAFinalizer:
    """An object whose finalizer gets the signal: its handler's exception is raised inside the finalizer, as when
    SQLAlchemy's pool or MLflow runs one (seen: "Exception ignored in: <function _collection_gced ...>")."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_whose_stop_a_finalizer_drops_still_stops_the_run_without_a_traceback(
        capfd: pytest.CaptureFixture) -> None:
    """Python drops an exception raised in a finalizer, printing "Exception ignored in ..." and its traceback: the
    signal's Stopped was lost, and a run outside its step loop (building, evaluating) went on."""
    from runner.engine import preemption

    with pytest.raises(preemption.Stopped, match="stopped by SIGTERM"):
        with preemption.handled():
            _SignalledInAFinalizer()  # dropped at once: its finalizer runs here
            deadline = time.time() + 60  # a bound for "never", not a measure of speed
            while time.time() < deadline:
                time.sleep(0.01)
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err
