"""Studies shared through a real PostgreSQL server (tests/servers/postgres.py), as README's recipe runs
them: the driver and an unreachable database in one line, one MLflow parent run however many sweep
processes start on a study together, and the MLflow run of a dead node's trial ended KILLED from what
the shared storage holds."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from hydra_plugins.runner_optuna_sweeper.storage import check_storage, database_problem, masked_url
from runner.specs.run import SpecError
from runner.specs.tracking import TrackingSpec
from runner.tracking.mlflow_store import check_tracking
from tests.hydra_plugins.test_shared_store import APP, CONFIG
from tests.servers.postgres import postgres_database, postgres_server, wait_until  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket closes


# --- defect 1: the driver and the database, one line each ---------------------------------------------


def _tracking_problem(uri: str, tmp_path: Path) -> str:
    with pytest.raises(SpecError) as raised:
        check_tracking(TrackingSpec(uri=uri, artifact_root=str(tmp_path / "art")))
    return str(raised.value)


def _storage_problem(url: str) -> str:
    # SweepConfigError, told by its exit code: Hydra's plugin scan re-executes the sweeper's modules, so the
    # class object raised may not be the one imported here (see optuna_sweeper.py)
    with pytest.raises(ValueError) as raised:
        check_storage(url)
    assert getattr(raised.value, "exit_code", None) == 2
    return str(raised.value)


def test_a_missing_driver_or_an_unreachable_database_is_one_line_naming_the_key_the_url_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _closed_port()
    psycopg2 = f"postgresql+psycopg2://alice:s3cret@127.0.0.1:{port}/optuna"
    down = f"postgresql://alice:s3cret@127.0.0.1:{port}/optuna"
    shown = {psycopg2: f"postgresql+psycopg2://alice:***@127.0.0.1:{port}/optuna",
             down: f"postgresql://alice:***@127.0.0.1:{port}/optuna"}
    for key, problem in (("hydra.sweeper.storage", _storage_problem), ("tracking.uri",
                                                                      lambda u: _tracking_problem(u, tmp_path))):
        message = problem(psycopg2)
        assert message == (f"{key}: {shown[psycopg2]}: its driver 'psycopg2' (postgresql+psycopg2) is not installed; "
                           "pip install psycopg2-binary (or drop '+psycopg2' to use psycopg 3: pip install "
                           "'runner[postgres]')")
        message = problem(down)
        assert message.startswith(f"{key}: {shown[down]}: no database server answers at 127.0.0.1:{port} ")
        assert message.endswith("start it, or check the host and port") and "\n" not in message
        assert "s3cret" not in message
    monkeypatch.setitem(sys.modules, "psycopg", None)  # psycopg absent: what plain postgresql:// needs
    assert _storage_problem(down) == (f"hydra.sweeper.storage: {shown[down]}: its driver 'psycopg' (postgresql) is not "
                                      "installed; pip install 'psycopg[binary]' (runner's extra: pip install "
                                      "'runner[postgres]')")
    assert masked_url("postgresql://bob@db/optuna") == "postgresql://bob@db/optuna"


def test_plain_postgresql_urls_open_the_study_and_a_wrong_database_is_one_line(postgres_server) -> None:
    """CI's PostgreSQL case: README's plain postgresql:// (psycopg 3) opens a study and an MLflow store;
    a database that does not exist is one line."""
    url = postgres_server.url(postgres_server.create_database())
    assert database_problem(url) is None
    check_storage(url)
    study = optuna.create_study(storage=url, study_name="recipe")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert len(optuna.load_study(storage=url, study_name="recipe").trials) == 2
    missing = postgres_server.url("no_such_db")
    assert re.match(r'^hydra\.sweeper\.storage: postgresql://runner@127\.0\.0\.1:\d+/no_such_db: cannot connect '
                    r'\(.*database "no_such_db" does not exist.*\); check ', _storage_problem(missing))


# --- the sweep command, end to end ----------------------------------------------------------------------


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(CONFIG)
    return tmp_path


def start(app: Path, name: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "STORE": str(app), "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'sweeper'}"}
    return subprocess.Popen([sys.executable, "app.py", "-m", f"hydra.sweep.dir={app}/{name}", *args], cwd=app, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def parents_and_children(uri: str) -> tuple[list, list]:
    client = MlflowClient(uri)
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return ([r for r in found if "mlflow.parentRunId" not in r.data.tags],
            [r for r in found if "mlflow.parentRunId" in r.data.tags])


@pytest.mark.slow
@pytest.mark.cluster
def test_the_sweep_command_with_a_missing_driver_exits_2_with_one_line(app: Path) -> None:
    url = f"postgresql+psycopg2://alice:s3cret@127.0.0.1:{_closed_port()}/optuna"
    p = start(app, "sweep", f"hydra.sweeper.storage={url}", "hydra.sweeper.study_name=s", "x=range(0, 3)")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"error: hydra.sweeper.storage: {masked_url(url)}: its driver 'psycopg2' (postgresql+psycopg2) is "
                     "not installed; pip install psycopg2-binary (or drop '+psycopg2' to use psycopg 3: pip install "
                     "'runner[postgres]')"], err


@pytest.mark.slow
@pytest.mark.cluster
def test_mlflow_server_on_postgresql_as_readme_starts_it(postgres_server, tmp_path: Path) -> None:
    """README: `mlflow server --backend-store-uri postgresql://...` with runner[postgres] installed."""
    url = postgres_server.url(postgres_server.create_database())
    port = _closed_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    server = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", url, "--host", "127.0.0.1", "--port",
                               str(port), "--artifacts-destination", str(tmp_path / "art"), "--workers", "1"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        def healthy() -> bool:
            try:
                import urllib.request

                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                return True
            except OSError:
                return server.poll() is not None
        assert wait_until(healthy, 120, every=1.0) and server.poll() is None, server.communicate()[0][-3000:]
        client = MlflowClient(f"http://127.0.0.1:{port}")
        run = client.create_run(client.create_experiment("recipe")).info.run_id
        client.log_metric(run, "loss", 0.5)
        client.set_terminated(run)
        assert client.get_run(run).data.metrics == {"loss": 0.5}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# --- defect 2: one parent run per study, however the processes race --------------------------------------


@pytest.mark.slow
@pytest.mark.cluster
def test_four_sweep_processes_started_together_on_a_postgresql_study_share_one_mlflow_parent_run(
        app: Path, postgres_database: str) -> None:
    tracking = f"sqlite:///{app}/mlflow.db"
    args = [f"hydra.sweeper.storage={postgres_database}", "hydra.sweeper.study_name=shared",
            "hydra.sweeper.n_trials=8", "hydra.sweeper.heartbeat_interval=1", "x=range(0, 99)"]
    procs = [start(app, f"sweep{i}", *args) for i in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in out + err
    parents, children = parents_and_children(tracking)
    assert len(parents) == 1, [(r.info.run_id, r.data.tags.get("runner.pid")) for r in parents]
    assert parents[0].info.status == "FINISHED"
    study = optuna.load_study(study_name="shared", storage=postgres_database)
    assert study.user_attrs["runner.mlflow_parent_run"] == parents[0].info.run_id
    assert len(children) == 8 and {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert optuna.get_all_study_names(postgres_database) == ["shared"]  # the claim is gone


# --- defects 3 and 8: a dead node's trial, and the killed sweep's parent run reused -----------------------


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the trial dies with its sweep by Linux's parent-death signal")
def test_a_dead_nodes_trial_ends_killed_from_the_storage_and_the_reused_parent_ends_finished_untagged(
        tmp_path: Path, postgres_database: str) -> None:
    """Node A's sweep is SIGKILLed mid-trial; its host is then "another machine": its run directory is
    gone and the trial's MLflow run names another host (so no orphan clean-up on this host ends it). Node
    B's sweep on the same PostgreSQL study fails the stale trial and must end its MLflow run KILLED from
    the storage alone (3); the parent run that A's death left KILLED is reused and ends FINISHED without
    runner.outcome=killed (8)."""
    from runner.search.trial import MLFLOW_RUN_ATTR, RUN_DIR_ATTR

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = ["-m", "hydra/sweeper=runner_optuna", f"hydra.sweeper.storage={postgres_database}",
            "hydra.sweeper.study_name=nodes", "hydra.sweeper.n_trials=1", "hydra.sweeper.heartbeat_interval=1",
            "hydra.sweeper.grace_period=2", "optimizer.lr=interval(0.01, 0.1)", "trainer.max_epochs=100000",
            f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path}/art"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'sweeper'}", "HYDRA_FULL_ERROR": "0"}
    node_a = subprocess.Popen([sys.executable, "-m", "runner", *args, f"hydra.sweep.dir={tmp_path}/a"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def trial() -> optuna.trial.FrozenTrial | None:
        try:
            trials = optuna.load_study(study_name="nodes", storage=postgres_database).trials
        except KeyError:
            return None
        return trials[0] if trials and MLFLOW_RUN_ATTR in trials[0].system_attrs else None
    try:
        assert wait_until(lambda: trial() is not None or node_a.poll() is not None, 300, every=0.5)
        assert node_a.poll() is None, node_a.communicate()[1][-3000:]
    finally:
        node_a.kill()
        node_a.communicate()
    run_id, run_dir = trial().system_attrs[MLFLOW_RUN_ATTR], Path(trial().system_attrs[RUN_DIR_ATTR])
    client = MlflowClient(uri)
    client.set_tag(run_id, "runner.host", "node-a")  # the trial ran on the dead node: its run dir is there
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    shutil.rmtree(run_dir)
    time.sleep(3)  # past the grace period: the trial is stale
    node_b = subprocess.run([sys.executable, "-m", "runner", *args, f"hydra.sweep.dir={tmp_path}/b"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert node_b.returncode == 0, node_b.stderr[-3000:]
    assert optuna.load_study(study_name="nodes", storage=postgres_database).trials[0].state.name == "FAIL"
    child = client.get_run(run_id)
    assert child.info.status == "KILLED" and child.data.tags["runner.outcome"] == "killed"
    parents, _ = parents_and_children(uri)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert "runner.outcome" not in parents[0].data.tags
