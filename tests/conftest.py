"""Shared test helpers: specs composed from conf/ exactly as the CLI composes them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.cli.registry import CONF_DIR
from runner.spec.metric_names import with_task_declarations
from runner.spec.run import RunSpec
from tests.temp_base import pytest_configure  # noqa: F401  (the suite's own temporary directories)

REPO = Path(__file__).resolve().parents[1]  # the checkout (CONF_DIR may be a link inside runner/)


def compose_spec(overrides: list[str], run_dir: Path, tracking_uri: str | None = None) -> RunSpec:
    """The RunSpec `python -m runner <overrides>` would build, with its run directory at run_dir."""
    if tracking_uri is None:
        overrides = [*overrides, "tracking=none"]
    else:
        overrides = [*overrides, f"tracking.uri={tracking_uri}", f"tracking.artifact_root={run_dir.parent / 'artifacts'}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    container = OmegaConf.to_container(cfg, resolve=True)
    container["run_dir"] = str(run_dir)
    return with_task_declarations(RunSpec.from_config(container, tuple(overrides)))


def run_cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m runner <args>` in a fresh process, with cwd (and so outputs/) in a temp dir."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def sqlite_uri(store: str) -> str:
    """A fresh store already migrated (a copy): tests of a first open of a new file name their own."""
    return store


@pytest.fixture(scope="session")
def migrated_mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty sqlite store MLflow has created once for the session: a module copies it (shutil.copy)
    rather than paying MLflow's schema migration (seconds) again."""
    import logging

    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    logging.getLogger().handlers.clear()  # alembic's migration logging
    return db


@pytest.fixture
def store(tmp_path: Path, migrated_mlflow_store: Path) -> str:
    """A fresh sqlite MLflow store for one test, its URI."""
    shutil.copy(migrated_mlflow_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"
