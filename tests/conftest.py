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

from runner.specs.registry import CONF_DIR
from runner.specs.metric_names import with_task_declarations
from runner.specs.run import RunSpec
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


@pytest.fixture(scope="session", autouse=True)
def _compose_cache_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The runs that tests start (in-process and `python -m runner`) keep their composed configs in the session's own
    cache (runner/cli/compose_cache.py), not in the user's ~/.cache/runner/composed."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))


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


class TwoRanks:
    """Two gloo processes (spawned once, one process group) that run a function on both ranks, test after
    test: a spawn costs seconds of interpreter start and imports per rank (CI budget), and nothing a test
    here asserts depends on its ranks being new processes (the launcher's own workers are tested through
    the CLI). fn(rank, world, *args) returns a report (plain values: a tensor is sent as shared memory);
    run() returns the two reports in rank order. A function that raises or hangs on either rank fails
    the test and ends both processes (the next run starts new ones)."""

    world = 2

    def __init__(self) -> None:
        self.procs: list = []
        self.inboxes: list = []

    def start(self) -> None:
        import torch.multiprocessing as mp

        from tests.runner.engine.test_parallel import free_port

        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        port = free_port()
        # not daemons: a daemon may not start DataLoader workers; the session's end closes them
        self.procs = [ctx.Process(target=_serve_rank, args=(rank, self.world, port, self.inboxes[rank], self.outbox))
                      for rank in range(self.world)]
        for proc in self.procs:
            proc.start()

    def run(self, fn, *args, timeout: float = 300) -> list:
        import queue

        if not self.procs or not all(proc.is_alive() for proc in self.procs):
            self.close()
            self.start()
        for inbox in self.inboxes:
            inbox.put((fn, args))
        replies = {}
        try:
            for _ in range(self.world):
                rank, ok, report = self.outbox.get(timeout=timeout)
                replies[rank] = (ok, report)
                if not ok:  # the other rank may wait in a collective for it: it gets a short while
                    timeout = 10
        except queue.Empty:
            pass
        if len(replies) < self.world or not all(ok for ok, _ in replies.values()):
            self.close()
            errors = [f"rank {rank}: {report}" for rank, (ok, report) in sorted(replies.items()) if not ok]
            missing = [f"rank {rank}: no report" for rank in range(self.world) if rank not in replies]
            raise AssertionError("\n".join([*errors, *missing]))
        return [replies[rank][1] for rank in range(self.world)]

    def close(self) -> None:
        # killed: nothing in them is left to keep, and an interpreter's exit with torch loaded takes seconds
        for proc in self.procs:
            proc.kill()
            proc.join()
        self.procs = []


def _serve_rank(rank: int, world: int, port: int, inbox, outbox) -> None:
    import traceback

    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # as torchrun's workers on a CPU: two ranks share the machine's cores
    torch.distributed.init_process_group("gloo")
    while (task := inbox.get()) is not None:
        fn, args = task
        try:
            outbox.put((rank, True, fn(rank, world, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def two_ranks():
    """The session's two gloo ranks (TwoRanks), started at the first test that asks."""
    ranks = TwoRanks()
    yield ranks
    ranks.close()
