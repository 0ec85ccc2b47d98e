"""Jobs that share a process (a grid multirun) each start from the state of a fresh `python -m runner`."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from runner.cli import process_state
from tests.conftest import run_cli


def test_isolated_undoes_flags_threads_environment_and_logger_levels() -> None:
    logging.getLogger("alembic")  # there before the job: the level the job gives it is undone
    before = process_state.snapshot()
    with process_state.isolated():
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = not before["cudnn_benchmark"]
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("medium")
        torch.set_num_threads(1)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        logging.getLogger("alembic").setLevel(logging.ERROR)
    after = process_state.snapshot()
    assert {k: v for k, v in after.items() if k != "log_levels"} == {k: v for k, v in before.items() if k != "log_levels"}
    assert {k: after["log_levels"][k] for k in before["log_levels"]} == before["log_levels"]
    assert before["log_levels"]["alembic"] != logging.ERROR


@pytest.mark.usefixtures("store")  # its tmp_path/mlflow.db comes migrated (tests/conftest.py): seconds saved
def test_a_grid_multiruns_jobs_start_from_the_same_process_state(tmp_path: Path) -> None:
    proc = run_cli(["-m", "trainer.deterministic=true,false", "trainer.max_steps=2", "trainer.progress_bar=off",
                    f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.artifact_root={tmp_path / 'art'}",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first, second = (yaml.safe_load((tmp_path / "sweep" / str(i) / "process_state.yaml").read_text()) for i in (0, 1))
    assert first["deterministic_algorithms"] is False and "CUBLAS_WORKSPACE_CONFIG" not in first["environ_sha256"]
    # job 0 turned determinism on and set CUBLAS_WORKSPACE_CONFIG: none of it leaked; the loggers of job 0's start
    # have their levels back (the libraries job 0 imported made more, with the levels they give them on import)
    assert {k: v for k, v in second.items() if k != "log_levels"} == {k: v for k, v in first.items() if k != "log_levels"}
    assert {k: second["log_levels"].get(k) for k in first["log_levels"]} == first["log_levels"]


def test_a_logger_a_job_imports_keeps_the_level_its_library_gives_it(tmp_path: Path) -> None:
    """Issue 35 item 12: SQLAlchemy sets its logger to WARNING when imported; a job's end put it to NOTSET, so
    a joblib worker's next trial printed every SQL statement of its study's sqlite storage under the INFO root.
    A fresh process, as a joblib worker's first job: the library is imported inside the job."""
    probe = ("import logging, sys\n"
             "from runner.cli import process_state\n"
             "assert 'sqlalchemy' not in sys.modules\n"
             "logging.basicConfig(level=logging.INFO)\n"
             "with process_state.isolated():\n"
             "    import sqlalchemy\n"
             "print(logging.getLevelName(logging.getLogger('sqlalchemy.engine.Engine').getEffectiveLevel()))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["WARNING"]
