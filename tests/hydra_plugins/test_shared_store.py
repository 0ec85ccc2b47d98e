"""Sweeps and multiruns sharing one MLflow store, through runner's sweep hook, on a tiny app whose
jobs log to MLflow as runner's do (open_client, owner_tags, a child of the parent run): several
processes starting at once on a fresh sqlite store, and a sweep killed with SIGKILL."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.tracking.mlflow_store import open_client
from tests.hydra_plugins.test_sweep_mechanics import alive, descendants

APP = '''
import os, time
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra_plugins.runner_optuna_sweeper.hook import sweep_hook


@hydra.main(version_base=None, config_path=".", config_name="config")
@sweep_hook("runner.search.sweep_hook.RunnerSweepHook")
def main(cfg) -> float:
    from runner.tracking.mlflow_store import open_client, open_experiment, owner_tags

    client = open_client(cfg.tracking.uri)
    experiment = open_experiment(client, cfg.tracking.experiment, cfg.tracking.uri, cfg.tracking.artifact_root)
    tags = {**owner_tags(), "mlflow.parentRunId": os.environ["RUNNER_PARENT_RUN_ID"]}
    run = client.create_run(experiment, run_name=f"job {HydraConfig.get().job.num}", tags=tags).info.run_id
    Path(cfg.marks).mkdir(exist_ok=True)
    (Path(cfg.marks) / run).touch()
    while Path(cfg.hang).exists():
        time.sleep(0.1)
    client.set_terminated(run)
    return float(cfg.x)


if __name__ == "__main__":
    main()
'''
CONFIG = '''
defaults:
  - override hydra/sweeper: runner_optuna

x: 1
marks: marks
hang: hang
trial: {storage: null, study_name: null, number: null}
objective: {direction: minimize}
tracking: {name: mlflow, uri: "sqlite:///${oc.env:STORE}/mlflow.db", experiment: runner, artifact_root: "${oc.env:STORE}/art"}

hydra:
  callbacks:
    mlflow_parent_run:
      _target_: runner.search.sweep_hook.ParentRunCallback
'''
OPTUNA = ["hydra.sweeper.n_trials=2", "hydra.sweeper.heartbeat_interval=1", "x=range(0, 9)"]


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(CONFIG)
    return tmp_path


def start(app: Path, name: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "STORE": str(app)}
    return subprocess.Popen([sys.executable, "app.py", "-m", f"hydra.sweep.dir={app}/{name}", *args], cwd=app, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def runs(app: Path) -> tuple[list, list]:
    client = MlflowClient(f"sqlite:///{app}/mlflow.db")
    found = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return ([r for r in found if "mlflow.parentRunId" not in r.data.tags],
            [r for r in found if "mlflow.parentRunId" in r.data.tags])


@pytest.mark.parametrize("sweeper", ["optuna", pytest.param("basic", marks=pytest.mark.slow)])  # one lock path: CI runs one
def test_two_multiruns_started_at_once_on_a_fresh_store_each_keep_their_parent_run(app: Path, sweeper: str) -> None:
    """Each process's first open of the store (its parent run's, its jobs') goes through the store lock:
    before, the Optuna parent run opened its own client, and a second sweep died migrating the fresh file."""
    args = [*OPTUNA, "hydra.sweeper.study_name=s{}"] if sweeper == "optuna" else ["hydra/sweeper=basic", "x=3,4"]
    procs = [start(app, f"sweep{i}", *[a.format(i) for a in args]) for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in out + err
    parents, children = runs(app)
    assert len(parents) == 2 and {r.info.status for r in parents} == {"FINISHED"}
    assert sorted(r.data.tags["runner.sweeper"] for r in parents) == [sweeper, sweeper]
    assert len(children) == 4 and {r.info.status for r in children} == {"FINISHED"}
    for parent in parents:  # two jobs under each parent
        assert sum(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_runs_of_a_sweep_killed_with_sigkill_end_killed_at_the_next_start_on_the_store(app: Path) -> None:
    (app / "hang").touch()
    sweep = start(app, "sweep", *OPTUNA, "hydra.sweeper.n_jobs=2")
    try:
        deadline = time.time() + 120
        while len(list((app / "marks").glob("*"))) < 2 and time.time() < deadline and sweep.poll() is None:
            time.sleep(0.2)
        assert len(list((app / "marks").glob("*"))) == 2, sweep.communicate()[1][-3000:] if sweep.poll() is not None else ""
        below = descendants(sweep.pid)
        sweep.send_signal(signal.SIGKILL)
        sweep.communicate()
        deadline = time.time() + 15
        while any(alive(p) for p in below) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in below if alive(p)]
    finally:
        for pid in descendants(sweep.pid) if sweep.poll() is None else ():
            os.kill(pid, signal.SIGKILL)
    parents, children = runs(app)
    assert [r.info.status for r in parents + children] == ["RUNNING"] * 3  # nobody was left to end them

    open_client(f"sqlite:///{app}/mlflow.db")  # what every runner command does first: a run, a sweep, a trial
    parents, children = runs(app)
    assert {r.info.run_id for r in children} == {p.name for p in (app / "marks").iterdir()}
    for r in parents + children:
        assert r.info.status == "KILLED" and r.data.tags["runner.outcome"] == "killed"
    assert [r.data.tags["runner.pid"] for r in parents] == [str(sweep.pid)]


def test_only_runs_whose_process_is_gone_from_this_host_are_ended(tmp_path: Path) -> None:
    """end_orphaned_runs, what every open of the store runs first: a killed owner's run ends KILLED, and
    so does one whose pid now names another process (a pid reused); a live owner's run, another host's
    and a run that names no owner stay RUNNING."""
    from runner.tracking.mlflow_store import HOST_TAG, PID_TAG, STARTED_TAG, end_orphaned_runs

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("runner")
    live, dead = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    dead.kill()
    dead.wait()
    host = os.uname().nodename
    started = Path(f"/proc/{live.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    owners = {"live": (live.pid, host, started), "dead": (dead.pid, host, ""), "reused": (live.pid, host, "1"),
              "elsewhere": (dead.pid, "another-host", ""), "untagged": None}
    ids = {}
    for name, owner in owners.items():
        tags = {PID_TAG: str(owner[0]), HOST_TAG: owner[1], STARTED_TAG: owner[2]} if owner else {}
        ids[name] = client.create_run(experiment, run_name=name, tags=tags).info.run_id
    try:
        assert sorted(end_orphaned_runs(client)) == sorted([ids["dead"], ids["reused"]])
    finally:
        live.kill()
        live.wait()
    status = {name: client.get_run(run_id).info.status for name, run_id in ids.items()}
    assert status == {"live": "RUNNING", "dead": "KILLED", "reused": "KILLED", "elsewhere": "RUNNING",
                      "untagged": "RUNNING"}
    assert client.get_run(ids["dead"]).data.tags["runner.outcome"] == "killed"
