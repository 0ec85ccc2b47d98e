"""The command line as a user types it: real processes, exit codes, messages, MLflow left clean."""
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import run_cli


def mlflow_runs(db: Path) -> list[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        return list(con.execute("select name, status from runs")) if "runs" in tables else []


BAD_INPUT = [
    (["precision=fp17"], "error: precision: unknown option 'fp17'; choose one of bf16, bf16_true, fp16, fp32, fp8, tf32"),
    (["optimizer.lr=abc"], "error: optimizer.lr: 'abc' is not a number; allowed: a value > 0"),
    (["optimizer.lr=-1"], "error: optimizer.lr: -1.0 is out of range; allowed: a value > 0"),
    (["+accum=0"], "error: accumulation.steps: 0 is out of range; allowed: a value > 0"),
    (["dataset.batch_size=0"], "error: dataset.batch_size: 0 is out of range; allowed: a value > 0"),
    (["+accum=4", "accumulation.steps=2"], "error: accum: +accum=4 conflicts with accumulation.steps=2; set only one"),
    (["trainer.resume=/nowhere/last.pt"], "error: trainer.resume: '/nowhere/last.pt' does not exist"),
    (["precision=tf32", "trainer.device=cpu"], "error: precision: tf32 needs an NVIDIA GPU"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_nonzero_exit_and_no_mlflow_run(tmp_path: Path, args: list[str], message: str) -> None:
    db = tmp_path / "mlflow.db"
    proc = run_cli([*args, f"tracking.uri=sqlite:///{db}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert mlflow_runs(db) == []


def test_default_run_trains_to_95_percent_and_prints_a_summary(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    proc = run_cli([f"tracking.uri=sqlite:///{db}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    best = float(proc.stdout.split("best val/acc: ")[1].split()[0])
    assert best >= 0.95
    assert "run directory: " in proc.stdout and "make ui" in proc.stdout
    assert mlflow_runs(db) == [("default", "FINISHED")]
    run_dirs = list((tmp_path / "outputs" / "runs").glob("*/*"))
    assert len(run_dirs) == 1 and (run_dirs[0] / "spec.yaml").exists() and (run_dirs[0] / "curves.png").exists()


def test_the_readme_command_works_as_typed_on_cpu(tmp_path: Path) -> None:
    proc = run_cli(["optimizer=adamw", "precision=bf16", "+accum=4", "trainer.max_epochs=2", "tracking=none"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    spec = next((tmp_path / "outputs" / "runs").glob("*/*/spec.yaml")).read_text()
    assert "steps: 4" in spec and "name: bf16" in spec and "name: adamw" in spec
