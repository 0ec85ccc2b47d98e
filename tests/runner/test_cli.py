"""The command line as a user types it: real processes, exit codes, messages, MLflow left clean."""
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli


def mlflow_runs(db: Path) -> list[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        return list(con.execute("select name, status from runs")) if "runs" in tables else []


# The bad-input matrix is tests/runner/test_bad_input.py.


@pytest.mark.parametrize("args", [["optimizer.lr=-1"], ["--cfg", "job"], ["--help"], ["optimizer.lrr=1"]],
                         ids=["bad value", "--cfg job", "--help", "unknown key"])
def test_checks_and_config_printing_import_neither_torch_nor_mlflow_nor_optuna(tmp_path: Path, args: list[str]) -> None:
    """The spec is checked before the heavy imports: -X importtime lists every module a process imports."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported  # the listing is real
    assert imported & {"torch", "mlflow", "optuna", "sklearn"} == set()
    assert proc.returncode == (2 if "=" in args[0] else 0), proc.stderr[-2000:]


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
    assert "steps: 4" in spec and "name: bf16" in spec and "_target_: torch.optim.AdamW" in spec
