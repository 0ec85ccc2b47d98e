"""No process of a run outlives its launcher (issue 35 item 8; runner/cli/lifetime.py): a real SIGKILL of
`python -m runner`, then every process it had started is gone and its MLflow run is not left RUNNING. The
order is read from events (a logged step, the processes' own exits), never from the machine's speed; the only
clock is a deadline for a process that would otherwise never end."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from tests.process_tree import alive, descendants

DEADLINE_S = 120  # a bound for "never", not a measure of speed: the workers' stop takes a step and a checkpoint


def _statuses(db: Path) -> list[str]:
    with sqlite3.connect(db, timeout=5) as con:
        return [status for (status,) in con.execute("select status from runs")]


def _start_and_wait_for_training(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    db = tmp_path / "mlflow.db"
    cmd = [sys.executable, "-m", "runner", "trainer.max_steps=100000", "trainer.eval_every_n_steps=0",
           "trainer.eval_every_epoch=false", "trainer.log_every_n_steps=1", "trainer.progress_bar=off",
           "trainer.memory_estimate=false", "trainer.checkpoint_every_n_steps=50", f"tracking.uri=sqlite:///{db}",
           f"tracking.artifact_root={tmp_path / 'art'}", "hydra.run.dir=run", *overrides]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    deadline = time.time() + DEADLINE_S
    while time.time() < deadline and launcher.poll() is None:  # the run has logged a training step
        try:
            with sqlite3.connect(db, timeout=1) as con:
                (logged,) = con.execute("select count(*) from metrics where key = 'train/loss'").fetchone()
        except sqlite3.Error:
            logged = 0
        if logged:
            break
        time.sleep(0.1)
    assert launcher.poll() is None, launcher.communicate()[1][-3000:]
    return launcher


def _kill_and_check(tmp_path: Path, launcher: subprocess.Popen, processes: int) -> None:
    started = descendants(launcher.pid)
    assert len(started) >= processes, started
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline and any(alive(p) for p in started):
            time.sleep(0.1)
        assert [p for p in started if alive(p)] == []
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert _statuses(tmp_path / "mlflow.db") == ["KILLED"]


def test_a_sigkilled_single_process_run_leaves_no_tracking_process_and_no_running_run(tmp_path: Path) -> None:
    """The tracking process outlives the training process only to end the run it left RUNNING."""
    launcher = _start_and_wait_for_training(tmp_path)
    _kill_and_check(tmp_path, launcher, processes=1)


def test_a_sigkilled_launcher_of_two_workers_leaves_no_worker_and_no_running_run(tmp_path: Path) -> None:
    """Before: both workers and their tracking process trained on, writing checkpoints, the run RUNNING."""
    launcher = _start_and_wait_for_training(tmp_path, "parallelism=ddp", "parallelism.nproc_per_node=2")
    _kill_and_check(tmp_path, launcher, processes=3)  # two workers and rank 0's tracking process


def test_a_pbt_member_ends_when_its_sweep_is_sigkilled(tmp_path: Path) -> None:
    """A PBT member started as the sweep starts it (population's member subprocess, n_jobs > 1) ends once the
    sweep process is SIGKILLed. Fast: the member waits on its job file, a FIFO this test holds open without
    writing, so it runs no training (tests/runner/search/test_pbt.py's slow test trains two members and reads
    their checkpoints and KILLED runs)."""
    job = tmp_path / "job.json"
    os.mkfifo(job)
    sweep = subprocess.Popen([sys.executable, "-c", "import sys; from runner.search.pbt import population; "
                              "population._run_subprocess(__import__('pathlib').Path(sys.argv[1]))", str(job)],
                             cwd=tmp_path, start_new_session=True)
    writer, member = None, None
    try:
        writer = open(job, "w")  # returns once the member has opened its job file: it watches its sweep by then
        (member,) = descendants(sweep.pid)
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait()
        deadline = time.time() + DEADLINE_S
        while time.time() < deadline and alive(member):
            time.sleep(0.1)
        assert not alive(member), "the member outlived its SIGKILLed sweep"
    finally:
        for pid in {sweep.pid, *([member] if member else [])}:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if writer is not None:
            writer.close()
