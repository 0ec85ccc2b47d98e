"""PBT's members as jobs of Hydra's launchers (runner/search/pbt/launcher.py; issue 24, defect 7: PBT ignored
`hydra/launcher` and ran its members as its own local processes).

A population of 2 digits MLPs, 6 optimizer steps in 2 rounds of 3, through `hydra/launcher=submitit_local`
and `joblib` ends exactly as through PBT's own local path with the same seed: the same members, hyperparameters,
lineage and objectives, the same MLflow metrics step by step. A sweep stopped by SIGTERM or killed by SIGKILL
stops its launcher's members (checkpoint written, MLflow run KILLED), and the same command goes on to the
uninterrupted result. A launcher that cannot serve is one line before anything runs.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from runner.search.pbt import launcher as members_launcher
from runner.specs.run import SpecError
from tests.conftest import REPO, run_cli
from tests.runner.search.test_pbt import _alive, _gone_within, _runs_by_name as _statuses

try:  # the one-host SLURM cluster (the slurm slice's tests/servers/slurm.py)
    from tests.servers.slurm import SlurmCluster, slurm_cluster  # noqa: F401  (the session's cluster)
except ImportError:
    SlurmCluster = None

    @pytest.fixture
    def slurm_cluster():
        pytest.skip("no one-host SLURM cluster: tests/servers/slurm.py is not in this checkout")

POPULATION = ["hparams_search=digits_pbt", "hydra.sweeper.population=2", "hydra.sweeper.quantile=0.5",
              "trainer.log_every_n_steps=1", "trainer.progress_bar=off", "trainer.memory_estimate=false"]
SMALL = ["trainer.max_steps=6", "hydra.sweeper.ready=3"]
KEYS = ("train/loss", "val/acc", "val/loss", "lr", "pbt/optimizer.lr", "pbt/optimizer.weight_decay")


def command(where: Path, *extra: str) -> list[str]:
    return ["-m", *POPULATION, f"hydra.sweep.dir={where / 'sweep'}", f"tracking.uri=sqlite:///{where / 'mlflow.db'}",
            f"tracking.artifact_root={where / 'art'}", *extra]


def outcome(where: Path) -> dict:
    """What a population ends with, without its paths and MLflow run ids: each member's hyperparameters,
    lineage, objectives and schedule, the best per round, and each member's MLflow metrics step by step."""
    state = json.loads((where / "sweep" / "pbt_state.json").read_text())
    client = MlflowClient(f"sqlite:///{where / 'mlflow.db'}")
    members, metrics = [], {}
    for member in state["members"]:
        run = client.get_run(member["run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.tags["mlflow.parentRunId"] == (where / "sweep" / "pbt_parent_run_id").read_text().strip()
        for key in KEYS:
            metrics[(member["id"], key)] = [(m.step, m.value) for m in client.get_metric_history(member["run_id"], key)]
        members.append({k: member[k] for k in ("id", "hparams", "objectives", "schedule", "seed")} |
                       {"lineage": [{k: v for k, v in e.items() if k != "run"} for e in member["lineage"]]})
    return {"members": members, "best_per_round": state["best_per_round"], "metrics": metrics}


@pytest.fixture(scope="module")
def local_population(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The population through PBT's own local path (Hydra's basic launcher, members in the sweep's process)."""
    where = tmp_path_factory.mktemp("local")
    done = run_cli([*command(where, *SMALL), "hydra.sweeper.n_jobs=1"], cwd=where, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"outcome": outcome(where), "best": _best_line(done.stdout)}


def _best_line(stdout: str) -> str:
    """`PBT: best val/acc 0.6037 (member 0, <its run directory>)` without the directory."""
    return next(line for line in stdout.splitlines() if line.startswith("PBT: best")).split(",")[0]


LAUNCHERS = {"submitit_local": ["hydra/launcher=submitit_local"],
             "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]}


@pytest.mark.slow  # ~3 min each on 2 busy cores: a job per member and round, each a fresh process
@pytest.mark.cluster
@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_a_population_through_a_launcher_ends_as_through_the_local_path(name: str, tmp_path: Path,
                                                                       local_population: dict) -> None:
    """Each member's round is a job of the launcher (its Hydra job directory and log beside its job file; for
    submitit one job folder per member and round), and the population ends exactly as the local path's:
    members, lineage, objectives, the best and every member's MLflow metrics, step by step, bitwise."""
    done = run_cli([*command(tmp_path, *SMALL), *LAUNCHERS[name], "hydra.sweeper.n_jobs=2"], cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _best_line(done.stdout) == local_population["best"]
    mine = outcome(tmp_path)
    assert mine == local_population["outcome"]
    assert any(m["lineage"] for m in mine["members"])  # an exploit happened: a checkpoint crossed between jobs
    sweep = tmp_path / "sweep"
    for member in (0, 1):
        for step in (3, 6):
            job = sweep / f"member-{member}" / "pbt" / f"job-{step:08d}"
            assert f"step {step}: val/acc" in (job / "runner.log").read_text()
            assert f"+pbt_job='{job}.json'" in (job / ".hydra" / "overrides.yaml").read_text()
    if name == "submitit_local":
        assert len([d for d in (sweep / ".submitit").iterdir() if d.name != "%j"]) == 4  # 2 members x 2 rounds
    assert not (sweep / members_launcher.ALIVE_FILE).exists()


def _launcher(name: str, **settings):
    from hydra.utils import instantiate

    if name == "joblib":
        from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf as conf
    elif name == "submitit_local":
        from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf as conf
    else:
        from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf as conf
    if name != "joblib":  # what these interpolate from the sweep's hydra node
        settings = {"submitit_folder": "unused", "name": "runner", **settings}
    return instantiate(OmegaConf.merge(OmegaConf.structured(conf), settings))


def test_a_launcher_that_cannot_serve_the_population_is_one_line() -> None:
    """joblib with one job runs members inside the sweep's process; a submitit job of several tasks or nodes would
    train one member several times; a SLURM array narrower than hydra.sweeper.n_jobs cannot train that many at
    once. Each is one line naming the key; launchers that can serve pass."""
    cases = [(("joblib", {"n_jobs": 1}), 1, "hydra.launcher.n_jobs: 1; joblib then runs every member inside the "
                                            "sweep's own process, one after another: leave hydra/launcher at basic"),
             (("joblib", {"n_jobs": 2}), 4, r"hydra.launcher.n_jobs: 2 \(2 at once\); hydra.sweeper.n_jobs=4 asks 4 "
                                            "members at once: raise hydra.launcher.n_jobs to 4"),
             (("submitit_local", {"tasks_per_node": 2}), 1, "hydra.launcher.tasks_per_node: 2; a PBT member trains in "
                                                            r"one process, so its job is one task on one node \(LocalLauncher\); allowed: 1"),
             (("submitit_slurm", {"nodes": 2}), 1, "hydra.launcher.nodes: 2; a PBT member trains in one process"),
             (("submitit_slurm", {"array_parallelism": 2}), 4, "hydra.launcher.array_parallelism: 2; "
                                                               "hydra.sweeper.n_jobs=4 asks 4 members at once: raise it to 4")]
    for (name, settings), n_jobs, message in cases:
        with pytest.raises(SpecError, match=f"^{message}"):
            members_launcher.check(_launcher(name, **settings), n_jobs)
    for name, settings, n_jobs in (("joblib", {"n_jobs": 4}, 4), ("submitit_local", {}, 4), ("submitit_slurm", {}, 4)):
        members_launcher.check(_launcher(name, **settings), n_jobs)
    assert members_launcher.is_basic(None) and not members_launcher.is_basic(_launcher("joblib"))


@pytest.mark.slow  # a CLI start: ~15 s on 2 busy cores
@pytest.mark.cluster
def test_a_refused_launcher_exits_2_in_one_line_before_anything_is_made(tmp_path: Path) -> None:
    done = run_cli(command(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: hydra.launcher.tasks_per_node: 2; a PBT member trains in one process, so its job is one task on one "
        "node (LocalLauncher); allowed: 1"]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "mlflow.db").exists()


# --- signals to a sweep whose members are submitit_local jobs

def _member_processes(where: Path) -> set[int]:
    """The submitit processes of this test's sweep (their command line names its .submitit folder)."""
    out = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "submitit" in text and str(where) in text:
            out.add(int(cmdline.parent.name))
    return out


def _start(where: Path, until, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    sweep = subprocess.Popen([sys.executable, "-m", "runner", *command(where, "hydra/launcher=submitit_local",
                                                                       "hydra.sweeper.n_jobs=2", *extra)],
                             cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    deadline = time.time() + 400
    while time.time() < deadline and sweep.poll() is None and not until():
        time.sleep(0.1)
    assert sweep.poll() is None, sweep.communicate()[1][-3000:]
    return sweep


def _both_training(where: Path) -> bool:
    import sqlite3

    try:
        with sqlite3.connect(where / "mlflow.db", timeout=1) as con:
            (training,) = con.execute("select count(distinct run_uuid) from metrics where key = 'train/loss'").fetchone()
    except sqlite3.Error:
        return False
    return training == 2


@pytest.mark.slow  # ~1 min
@pytest.mark.cluster
def test_a_sigtermed_sweep_stops_its_launchers_members_and_ends_killed_in_one_line(tmp_path: Path) -> None:
    """SIGTERM to the sweep process alone while its 2 members train as submitit_local jobs: the members stop at a
    step boundary with their checkpoint and end KILLED, the parent ends KILLED, one line, exit 143."""
    sweep = _start(tmp_path, lambda: _both_training(tmp_path), "trainer.max_steps=4000", "hydra.sweeper.ready=2000")
    members = _member_processes(tmp_path)
    try:
        assert members
        os.kill(sweep.pid, signal.SIGTERM)
        _, err = sweep.communicate(timeout=180)
        assert _gone_within(members, 15)
    finally:
        for pid in (sweep.pid, *members):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert sweep.returncode == 143, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == \
        "runner: stopped by SIGTERM; the run was marked KILLED"
    statuses = _statuses(tmp_path / "mlflow.db")
    assert [statuses[f"pbt member {i}"] for i in (0, 1)] == ["KILLED", "KILLED"]
    assert [s for name, s in statuses.items() if name.startswith("pbt ") and "member" not in name] == ["KILLED"]
    for i in (0, 1):
        assert list((tmp_path / "sweep" / f"member-{i}" / "checkpoints").glob("step-*")), f"member {i}: no checkpoint"


@pytest.mark.slow  # ~5 min: a killed sweep of submitit_local jobs and its rerun, beside the local population
@pytest.mark.cluster
def test_a_sigkilled_sweep_stops_its_launchers_members_and_reruns_to_the_uninterrupted_result(
        tmp_path: Path, local_population: dict) -> None:
    """SIGKILL of the sweep process alone while round 2's submitit_local jobs run: the members notice (their sweep's
    process is gone) and stop; the same command on the same sweep directory ends exactly as the uninterrupted
    local population, every step logged once."""
    round_2 = [tmp_path / "sweep" / f"member-{i}" / "pbt" / "job-00000006" / "runner.log" for i in (0, 1)]
    sweep = _start(tmp_path, lambda: all(p.is_file() for p in round_2), *SMALL)
    members = _member_processes(tmp_path)
    try:
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait()
        assert _gone_within(members, 30)
    finally:
        for pid in members:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    before = json.loads((tmp_path / "sweep" / "pbt_state.json").read_text())
    assert before["round"] == 1
    again = run_cli([*command(tmp_path, *SMALL), "hydra/launcher=submitit_local", "hydra.sweeper.n_jobs=2"],
                    cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert outcome(tmp_path) == local_population["outcome"]  # each metric once per step, as uninterrupted


def _process_writing(log: Path) -> int | None:
    """The process that holds `log` open (a member job's Hydra file handler keeps its runner.log open)."""
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == str(log) for fd in fd_dir.iterdir()):
                return int(fd_dir.parent.name)
        except OSError:
            continue
    return None


def _max_step(where: Path, run_name: str) -> int:
    import sqlite3

    try:
        with sqlite3.connect(where / "mlflow.db", timeout=1) as con:
            (top,) = con.execute("select max(m.step) from metrics m join runs r on m.run_uuid = r.run_uuid where "
                                 "m.key = 'train/loss' and r.name = ?", (run_name,)).fetchone()
    except sqlite3.Error:
        return 0
    return top or 0


@pytest.mark.slow  # ~3 min
@pytest.mark.cluster
def test_a_member_preempted_by_its_own_signal_is_launched_again_and_goes_on_from_its_checkpoint(tmp_path: Path) -> None:
    """SIGTERM to member 0's submitit_local job alone in round 1 (as a SLURM preemption sends it) while the sweep
    runs: the member stops at a step boundary with its checkpoint, the sweep launches it again, and it goes on
    from that step: every train/loss step logged once, its MLflow run FINISHED, the population complete."""
    log = tmp_path / "sweep" / "member-0" / "pbt" / "job-00000600" / "runner.log"
    sweep = _start(tmp_path, lambda: _max_step(tmp_path, "pbt member 0") >= 10, "trainer.max_steps=1200",
                   "hydra.sweeper.ready=600")
    try:
        member = _process_writing(log)
        assert member is not None
        os.kill(member, signal.SIGTERM)
        out, err = sweep.communicate(timeout=500)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == 0, err[-3000:]
    said = re.search(r"PBT: member 0 was stopped \(stopped by SIGTERM at step (\d+)\); launching it again from its "
                     "checkpoint", out + err)
    assert said and 10 <= int(said[1]) < 600, (out + err)[-3000:]  # in round 1, at a step boundary
    state = json.loads((tmp_path / "sweep" / "pbt_state.json").read_text())
    assert state["round"] == 2
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for member in state["members"]:
        assert [m.step for m in client.get_metric_history(member["run_id"], "train/loss")] == list(range(1, 1201))
        assert client.get_run(member["run_id"]).info.status == "FINISHED"


@pytest.mark.slow  # ~4 min: a SLURM job per member and round on the one-host cluster
@pytest.mark.cluster
def test_a_population_through_submitit_slurm_ends_as_through_the_local_path(slurm_cluster, tmp_path: Path,
                                                                           local_population: dict) -> None:
    """Each member's round is a SLURM job (submitit_slurm on the one-host cluster; the sweep directory is the
    disk both nodes share), and the population ends exactly as the local path's."""
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "sweeper"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "runner", *command(tmp_path, *SMALL), "hydra/launcher=submitit_slurm",
                           "hydra.sweeper.n_jobs=2", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=20"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _best_line(done.stdout) == local_population["best"]
    mine = outcome(tmp_path)
    assert mine == local_population["outcome"]
    assert any(m["lineage"] for m in mine["members"])  # an exploit: a checkpoint crossed jobs on the shared disk
    jobs = [d.name for d in (tmp_path / "sweep" / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", d.name)]
    assert len(jobs) == 4  # 2 members x 2 rounds, each its own SLURM job (an array task: <array id>_<member>)
    # a job hands its result over before SLURM ends it
    assert [slurm_cluster.wait(job, timeout=120)["JobState"] for job in jobs] == ["COMPLETED"] * 4
