"""Jobs that share a process (a grid multirun) each start from the state of a fresh `python -m runner`."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import yaml

from runner.cli import process_state
from tests.conftest import run_cli


def test_isolated_undoes_flags_threads_environment_and_logger_levels() -> None:
    before = process_state.snapshot()
    with process_state.isolated():
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = not before["cudnn_benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("medium")
        torch.set_num_threads(1)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        logging.getLogger("alembic").setLevel(logging.ERROR)
    assert process_state.snapshot() == before


@pytest.mark.usefixtures("store")  # its tmp_path/mlflow.db comes migrated (tests/conftest.py): seconds saved
def test_a_grid_multiruns_jobs_start_from_the_same_process_state(tmp_path: Path) -> None:
    proc = run_cli(["-m", "trainer.deterministic=true,false", "trainer.max_steps=2", "trainer.progress_bar=off",
                    f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.artifact_root={tmp_path / 'art'}",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, second = (yaml.safe_load((tmp_path / "sweep" / str(i) / "process_state.yaml").read_text()) for i in (0, 1))
    assert first["deterministic_algorithms"] is False and "CUBLAS_WORKSPACE_CONFIG" not in first["environ_sha256"]
    assert second == first  # job 0 turned determinism on and set CUBLAS_WORKSPACE_CONFIG: none of it leaked
