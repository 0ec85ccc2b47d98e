"""SIGTERM to an Optuna sweep whose trials run in slot processes (n_jobs=2): it stops as on Ctrl-C, its trials
stopped at a step boundary, its parent run ended KILLED, in one line and exit 143 (issue 35 item 12; before,
the sweep process died on the spot, no summary, its parent run left RUNNING). Order from events: the signal
goes once both trials have logged a training step."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path


def test_a_sigtermed_sweep_with_slot_processes_stops_its_trials_and_ends_killed_in_one_line(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    cmd = [sys.executable, "-m", "runner", "-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2",
           "hydra.sweeper.n_jobs=2", "hydra/sweeper/pruner=none", "trainer.max_steps=100000",
           "trainer.log_every_n_steps=1", "trainer.progress_bar=off", "trainer.memory_estimate=false",
           f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={tmp_path / 'art'}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    sweep = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.time() + 240  # a bound for "never", not a measure of speed
        training = 0
        while time.time() < deadline and sweep.poll() is None and training < 2:
            try:
                with sqlite3.connect(db, timeout=1) as con:
                    (training,) = con.execute(
                        "select count(distinct run_uuid) from metrics where key = 'train/loss'").fetchone()
            except sqlite3.Error:
                training = 0
            time.sleep(0.1)
        assert sweep.poll() is None and training == 2, sweep.communicate()[1][-3000:]
        os.kill(sweep.pid, signal.SIGTERM)
        _, err = sweep.communicate(timeout=240)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "runner: stopped by SIGTERM; the run was marked KILLED"
    assert "Traceback" not in err and "Exception ignored" not in err
    with sqlite3.connect(db, timeout=5) as con:
        statuses = sorted(status for (status,) in con.execute("select status from runs"))
    assert statuses == ["KILLED", "KILLED", "KILLED"]  # the parent run and both trials' runs
