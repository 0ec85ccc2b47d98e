"""Messages of issue 35's item 13 that concern compositions and the finders: each says what happened, under the
key that decides it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import compose_spec, run_cli


def _report(tmp_path: Path, last_lr: float) -> str:
    from runner.tune.lr_find import LrCurve, LrSuggestion, describe

    spec = compose_spec(["tune=lr_find", "tune.max_lr=10"], tmp_path / "run")
    curve = LrCurve(lrs=[1e-3, 1e-2, 1e-1, last_lr], losses=[2.0, 1.5, 1.0, 0.9], smoothed=[2.0, 1.5, 1.0, 0.9])
    suggestion = LrSuggestion(lr=0.01, steepest_lr=0.01, slope=-0.2, lowest_lr=last_lr, lowest_loss=0.9,
                              diverged_at=None, reason="steepest descent")
    return "\n".join(describe(spec, curve, suggestion))


def test_lr_find_names_tune_max_lr_only_where_the_sweep_reached_it(tmp_path: Path) -> None:
    """A sweep that stopped at lr 2.7 of max_lr 10 said "no divergence up to tune.max_lr=2.7"."""
    short = _report(tmp_path, 2.7)
    assert "no divergence up to lr 2.7, the last measured (tune.max_lr=10 was not reached)" in short
    assert "tune.max_lr=2.7" not in short
    assert "no divergence up to tune.max_lr=10" in _report(tmp_path, 10.0)


@pytest.mark.parametrize("typed", ["logger=wandb", "logger.name=wandb"])
def test_a_loggers_key_is_told_that_tracking_is_the_logger_group(tmp_path: Path, typed: str) -> None:
    proc = run_cli([typed], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: logger: unknown key; Lightning's logger is runner's tracking group: "
                                   "tracking=mlflow or none (tracking.uri, tracking.experiment)")



@pytest.mark.parametrize("end_said", [False, True])
def test_a_tracking_process_lost_after_the_run_ended_is_said_plainly_not_as_training_going_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, end_said: bool) -> None:
    """Issue 35, item 13: an outage that outlasted the run ended with "the tracking process ... ended (killed by signal
    9) (seen at step N); training goes on": the process stops its tracking process as it exits, and the writer,
    still trying, said training went on. A real tracking process, killed after the run's end was handed over."""
    import signal

    from runner.tracking.store_process import StoreProcess
    from runner.tracking.writer import StoreWriter

    process = StoreProcess()
    writer = StoreWriter(process, "0" * 32, "http://store.invalid", str(tmp_path / "journal"), send_every_s=60,
                         patience_s=1)
    try:
        writer.metrics(7, 0, {"loss": 1.0, "acc": 0.5})
        writer.call(lambda store: store.set_terminated("0" * 32, "FINISHED"), "the run's end")
        writer.end_said = end_said  # True: the tracker's line at the run's end said it (tracker.finish)
        os.kill(process.proc.pid, signal.SIGKILL)
        process.proc.wait()
        with caplog.at_level("WARNING"):
            writer.close()  # the run has ended: the thread sends what is left, and finds the process gone
            writer._thread.join(timeout=30)
    finally:
        process.close(timeout=1)
    said = [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()]
    assert not any("training goes on" in m for m in said), said
    if end_said:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(
            "MLflow at http://store.invalid: the run has finished, but 2 metric values (from step 7), the run's end "
            "could not be written (the tracking process (pid "), said
        assert f"(killed by signal 9)); {tmp_path / 'journal'} holds them" in said[0]


def test_a_store_a_user_made_read_only_with_chmod_is_one_line_exit_2_and_nothing_is_made(tmp_path: Path,
                                                                                        store: str) -> None:
    """Issue 35, item 13 (a read-only store gave 801 lines of SQLAlchemy's tracebacks): `chmod a-w mlflow.db`, as a
    user types it, then a run. Root writes through permission bits, so as root the run drops the capability that
    lets it (a user's process has none)."""
    import shutil
    import subprocess
    import sys

    db = Path(store.removeprefix("sqlite:///"))
    db.chmod(0o444)
    command = [sys.executable, "-m", "runner", f"tracking.uri={store}", f"hydra.run.dir={tmp_path / 'run'}",
               "trainer.max_steps=1"]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root writes through permission bits, and setpriv is not here to drop that")
        command = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                   "--bounding-set=-dac_override,-dac_read_search", *command]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (f"error: tracking.uri: the MLflow store {db} is read-only; make it writable or "
                                   "point tracking.uri at another file"), proc.stderr[-3000:]
    assert not proc.stdout.strip() and not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()
