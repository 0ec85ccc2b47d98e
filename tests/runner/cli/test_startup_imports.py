"""What a plain run has imported by the end of its first optimizer step: nothing it does not use by then.
Each module below costs start-up time (benchmarks/bench_startup.py) and is imported where it is used: torch's
elastic rendezvous by a launch that starts workers, DCP by a checkpoint, Optuna, SQLAlchemy, alembic and
MLflow (with pandas) by sweeps, a fresh store or a tracking process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

NOT_BY_THE_FIRST_STEP = ("torch.distributed.elastic.rendezvous", "torch.distributed.checkpoint", "optuna", "sqlalchemy",
                         "alembic", "mlflow", "pandas", "runner.search.cross_validation")


def test_a_plain_run_imports_no_heavy_module_it_does_not_use_before_its_first_step(tmp_path: Path) -> None:
    listing = tmp_path / "modules.txt"
    args = ["trainer.max_steps=1", "tracking=none",
            f"trainer.callbacks=[{{_target_: tests.runner.cli.modules_at_first_step.ModulesAtFirstStep, path: '{listing}'}}]"]
    # the add-on's package importable as a user's is (a fresh clone does not install tests/)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = set(listing.read_text().split())
    assert "torch" in imported and "runner.engine.engine" in imported  # the listing is the run's
    assert {m for m in imported if m.startswith(NOT_BY_THE_FIRST_STEP)} == set()


# the main process's write probes (runner/tracking/mlflow_store.py: a file written and synced), counted
COUNT_PROBES = """
import atexit, runpy, sys
from runner.tracking import mlflow_store
probe, probed = mlflow_store._check_writable, []
def counted(directory, *args):
    probed.append(str(directory))
    return probe(directory, *args)
mlflow_store._check_writable = counted
atexit.register(lambda: print(f"store probes: {len(probed)}"))
sys.argv = ["runner", *sys.argv[1:]]
runpy.run_module("runner", run_name="__main__")
"""


def test_a_single_run_probes_its_store_once_before_it_starts(tmp_path: Path, store: str) -> None:
    """preflight's check of the store is the run's: its launch and its tracker, moments later, do not write
    probe files into the store's and the artifacts' folders again (two probes, not six)."""
    proc = subprocess.run([sys.executable, "-c", COUNT_PROBES, "trainer.max_steps=1", f"tracking.uri={store}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "store probes: 2\n" in proc.stdout, proc.stdout[-800:]
