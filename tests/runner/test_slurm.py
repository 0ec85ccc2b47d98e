"""runner on a real one-host SLURM cluster (tests/servers/slurm.py): the README's sbatch templates, a job
preempted for real that requeues itself and finishes as if never stopped, a two-node job signalled on both
nodes that does the same, a two-node job that loses a node (one line, then a resume as if never stopped), the
`hydra/launcher=slurm` defaults on a CPU partition and its refusal. One fast case (the trivial job) runs in
CI; the rest are slow."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from runner.engine import checkpoint
from tests.conftest import REPO
from tests.servers.slurm import SlurmCluster, slurm_cluster  # noqa: F401  (the session's cluster)

pytestmark = pytest.mark.cluster
ONE_NODE = REPO / "examples" / "slurm" / "one_node.sbatch"


def test_the_one_host_cluster_runs_a_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """`sbatch --wait` of a trivial job: two nodes up, the job runs on one of them and exits 0."""
    out = subprocess.run(["sbatch", "--wait", "-N1", "-o", str(tmp_path / "out.txt"), "--wrap",
                          "echo ran on $SLURM_JOB_NODELIST"], env=slurm_cluster.env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out.txt").read_text().strip() in {f"ran on {n}" for n in slurm_cluster.nodes}
    states = slurm_cluster.command("sinfo", "-h", "-N", "-p", "debug", "-o", "%N").stdout.split()
    assert sorted(states) == sorted(slurm_cluster.nodes)


# --- a preempted job requeues itself and finishes as an uninterrupted run ------------------------------

RUN = ["optimizer=adamw", "scheduler=warmup_cosine", "scheduler.warmup=5", "trainer.max_steps=1000",
       "trainer.checkpoint_every_n_steps=25", "trainer.keep_checkpoints=50", "trainer.eval_every_n_steps=100",
       "trainer.log_every_n_steps=5", "trainer.progress_bar=off", "trainer.memory_estimate=false", "trainer.device=cpu"]


def _job_env(cluster: SlurmCluster) -> dict:
    return {**cluster.env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "sweeper"), os.environ.get("PYTHONPATH", "")])}


def _store(tmp_path: Path, name: str, template: Path) -> list[str]:
    db = tmp_path / f"{name}.db"
    shutil.copy(template, db)
    return [f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={tmp_path / name}-artifacts"]


def _mlflow_runs(db: Path) -> list[tuple[str, dict]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    return [(run.info.status, {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                               for key in run.data.metrics})
            for run in client.search_runs([e.experiment_id for e in client.search_experiments()])]


def _wait_for(what: str, condition, timeout: float, job_log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g} s; the job's log:\n"
                                 + (job_log.read_text() if job_log.exists() else "(none)"))
        time.sleep(0.2)


@pytest.mark.slow
def test_a_preempted_job_requeues_itself_and_finishes_bitwise_as_an_uninterrupted_one(
        slurm_cluster: SlurmCluster, tmp_path: Path, migrated_mlflow_store: Path) -> None:
    """README's one-node template, submitted as written (--requeue, --signal=TERM@120, srun). A job of the
    high partition preempts it for real mid-training: SLURM sends SIGTERM to the srun step, the run writes
    that step's checkpoint, ends its MLflow run KILLED and requeues its own job (SLURM alone would end it
    PREEMPTED/FAILED). The job comes back (SLURM_RESTART_COUNT=1), continues in the same run directory and
    MLflow run, and ends COMPLETED with the weights and metric history of a run never stopped."""
    uninterrupted = subprocess.Popen(
        [sys.executable, "-m", "runner", *RUN, f"hydra.run.dir={tmp_path / 'uninterrupted'}",
         *_store(tmp_path, "uninterrupted", migrated_mlflow_store)],
        cwd=tmp_path, env=_job_env(slurm_cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job_log, run_dir = tmp_path / "job.log", tmp_path / "preempted"
    try:
        job = slurm_cluster.sbatch("--cpus-per-task=1", "--time=30", "-o", str(job_log), str(ONE_NODE), *RUN,
                                   *_store(tmp_path, "preempted", migrated_mlflow_store),
                                   cwd=tmp_path, env={**_job_env(slurm_cluster), "RUN_DIR": str(run_dir)})
        _wait_for("the job's first checkpoint", lambda: any((run_dir / "checkpoints").glob("step-*.pt")), 240, job_log)
        # every CPU of both nodes: SLURM preempts the training job (PreemptMode=CANCEL, GraceTime) to run this
        slurm_cluster.sbatch("-p", "high", "-n", str(2 * len(slurm_cluster.nodes)), "-o", "/dev/null", "--wrap", "true")
        _wait_for("the preemption", lambda: slurm_cluster.job(job)["JobState"] not in ("RUNNING", "COMPLETING"), 120,
                  job_log)
        assert slurm_cluster.job(job)["JobState"] == "PENDING", job_log.read_text()  # requeued, not PREEMPTED/FAILED
        # SLURM holds a requeued job for about two minutes before it may start again: now, for the test
        slurm_cluster.command("scontrol", "update", f"JobId={job}", "StartTime=now")
        final = slurm_cluster.wait(job, timeout=300)
        assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stdout.read()
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
            uninterrupted.wait()
    # the run's own log (runner.log in its directory) beside the job's: the requeue ends the srun step at
    # once, and what srun had not yet forwarded from the stopped process never reaches the job's log
    log = job_log.read_text() + "\n" + (run_dir / "runner.log").read_text()
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", log
    assert "SIGTERM: stopped at step " in log and f"SLURM job {job} requeues itself: it continues this run" in log, log
    stopped_at = int(log.split("SIGTERM: stopped at step ")[1].split()[0])
    assert f"resuming at step {stopped_at} " in log, log
    assert 25 <= stopped_at < 1000, log
    got, want = checkpoint.load(run_dir / "checkpoints" / "last.pt"), \
        checkpoint.load(tmp_path / "uninterrupted" / "checkpoints" / "last.pt")
    assert got["progress"]["step"] == 1000
    assert all(got["model"][k].equal(want["model"][k]) for k in want["model"])
    [(status, history)] = _mlflow_runs(tmp_path / "preempted.db")
    [(_, want_history)] = _mlflow_runs(tmp_path / "uninterrupted.db")
    timing = {k for k in want_history if k.startswith("throughput/")}
    assert status == "FINISHED"
    assert {k: v for k, v in history.items() if k not in timing} == {k: v for k, v in want_history.items() if k not in timing}


@pytest.mark.slow
def test_the_multi_node_template_trains_two_nodes_as_one_process(
        slurm_cluster: SlurmCluster, tmp_path: Path, migrated_mlflow_store: Path) -> None:
    """README's N-node template on both nodes of the cluster (one run directory they share, as on a cluster's
    shared disk): the head node from `scontrol show hostnames`, one srun task per node with its
    SLURM_NODEID as node rank, ddp across them. The job COMPLETES, node 0 holds the run, one MLflow run
    ends FINISHED, and weights and train/loss are those of one process with the same global batch."""
    from tests.servers.mlflow import free_port

    short = [arg for arg in RUN if not arg.startswith(("trainer.max_steps", "trainer.eval_every"))] + \
        ["trainer.max_steps=60", "trainer.eval_every_n_steps=30"]
    one = subprocess.run([sys.executable, "-m", "runner", *short, f"hydra.run.dir={tmp_path / 'one'}",
                          *_store(tmp_path, "one", migrated_mlflow_store)],
                         cwd=tmp_path, env=_job_env(slurm_cluster), capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    job_log, run_dir = tmp_path / "job.log", tmp_path / "two-nodes"
    job = slurm_cluster.sbatch("--nodes=2", "--cpus-per-task=1", "--time=30", "-o", str(job_log),
                               str(REPO / "examples" / "slurm" / "multi_node.sbatch"), *short,
                               *_store(tmp_path, "two", migrated_mlflow_store), "parallelism.rdzv_timeout=120",
                               "dataset.batch_size=32",  # per rank: the one process's global batch of 64
                               cwd=tmp_path, env={**_job_env(slurm_cluster), "RUN_DIR": str(run_dir),
                                                  "PORT": str(free_port())})
    final = slurm_cluster.wait(job, timeout=600)
    log = job_log.read_text()
    assert final["JobState"] == "COMPLETED", log
    assert "2 nodes x 1" in log, log
    got, want = checkpoint.load(run_dir / "checkpoints" / "last.pt"), checkpoint.load(tmp_path / "one" / "checkpoints" / "last.pt")
    assert got["progress"]["step"] == want["progress"]["step"] == 60
    for key in want["model"]:
        torch.testing.assert_close(got["model"][key], want["model"][key], rtol=1e-5, atol=1e-5, msg=key)
    assert yaml.safe_load((run_dir / "spec.yaml").read_text())["parallelism"]["node_rank"] == 0
    [(status, history)] = _mlflow_runs(tmp_path / "two.db")
    [(_, want_history)] = _mlflow_runs(tmp_path / "one.db")
    assert status == "FINISHED"
    assert [step for step, _ in history["train/loss"]] == [step for step, _ in want_history["train/loss"]]
    torch.testing.assert_close(torch.tensor([v for _, v in history["train/loss"]]),
                               torch.tensor([v for _, v in want_history["train/loss"]]), rtol=1e-5, atol=1e-5)


# --- two nodes: a signalled job requeues itself, a lost node is one line ----------------------------------

MULTI_NODE = REPO / "examples" / "slurm" / "multi_node.sbatch"
TWO_NODES = [arg for arg in RUN if not arg.startswith(("trainer.max_steps", "trainer.eval_every"))] + \
    ["trainer.max_steps=400", "trainer.eval_every_n_steps=100", "parallelism.rdzv_timeout=60"]


def _submit_two_nodes(cluster: SlurmCluster, tmp_path: Path, name: str, template: Path, *extra: str,
                      log_name: str | None = None) -> tuple[int, Path, Path]:
    """multi_node.sbatch on both nodes (a run directory they share, and an MLflow store named `name`, made on the
    first submission); (job id, run directory, job log)."""
    from tests.servers.mlflow import free_port

    job_log, run_dir = tmp_path / f"{log_name or name}.log", tmp_path / name
    store = [f"tracking.uri=sqlite:///{tmp_path / name}.db", f"tracking.artifact_root={tmp_path / name}-artifacts"]
    if not (tmp_path / f"{name}.db").exists():
        store = _store(tmp_path, name, template)
    job = cluster.sbatch("--nodes=2", "--cpus-per-task=1", "--time=30", "-o", str(job_log), str(MULTI_NODE),
                         *TWO_NODES, *store, *extra, cwd=tmp_path,
                         env={**_job_env(cluster), "RUN_DIR": str(run_dir), "PORT": str(free_port())})
    return job, run_dir, job_log


def _job_processes(job: int, node_id: int) -> list[int]:
    """The pids of the job's runner processes on one node (its srun task's launcher and workers): the one-host
    cluster's two nodes share this host, so the node is told by the process's SLURM_NODEID."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (proc / "environ").read_text(errors="replace").split("\0")
                       if "=" in item)
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") == str(job) and env.get("SLURM_NODEID") == str(node_id) and b"runner" in cmdline \
                and env.get("SLURM_STEP_ID") not in (None, "batch"):
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def two_node_reference(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory,
                       migrated_mlflow_store: Path):
    """An uninterrupted two-node job of TWO_NODES, submitted once for the module (it runs beside each test's own
    job: both ask one CPU per node); `wait()` gives its weights and metric history."""
    tmp = tmp_path_factory.mktemp("two-node-reference")
    job, run_dir, job_log = _submit_two_nodes(slurm_cluster, tmp, "reference", migrated_mlflow_store)
    done: dict = {}

    def wait() -> tuple[dict, dict]:
        if not done:
            final = slurm_cluster.wait(job, timeout=900)
            assert final["JobState"] == "COMPLETED", job_log.read_text()
            [(status, history)] = _mlflow_runs(tmp / "reference.db")
            assert status == "FINISHED"
            done["result"] = checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"], history
        return done["result"]

    return wait


def _assert_as_reference(run_dir: Path, db: Path, reference) -> None:
    want_model, want_history = reference()
    got = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert got["progress"]["step"] == 400
    assert all(got["model"][k].equal(want_model[k]) for k in want_model)
    [(status, history)] = _mlflow_runs(db)
    timing = {k for k in want_history if k.startswith("throughput/")}
    assert status == "FINISHED"
    assert {k: v for k, v in history.items() if k not in timing} == {k: v for k, v in want_history.items() if k not in timing}


@pytest.mark.slow
def test_a_signalled_two_node_job_requeues_itself_and_finishes_bitwise_as_an_uninterrupted_one(
        slurm_cluster: SlurmCluster, tmp_path: Path, migrated_mlflow_store: Path, two_node_reference) -> None:
    """README's N-node template on both nodes; SIGTERM to its srun tasks on both nodes mid-training (what
    --signal=TERM@<s> sends before the time limit, and a preemption at once): the workers of both nodes stop
    at one step and write its checkpoint, node 0's task requeues the job, and the job comes back by itself,
    continues in the same run directory and MLflow run, and ends COMPLETED with the weights and metric history
    of an uninterrupted two-node job, bitwise."""
    job, run_dir, job_log = _submit_two_nodes(slurm_cluster, tmp_path, "signalled", migrated_mlflow_store)
    _wait_for("the job's first checkpoint", lambda: any((run_dir / "checkpoints").glob("step-*.pt")), 600, job_log)
    slurm_cluster.command("scancel", "--signal=TERM", str(job))
    _wait_for("the requeue", lambda: slurm_cluster.job(job)["JobState"] not in ("RUNNING", "COMPLETING"), 120, job_log)
    assert slurm_cluster.job(job)["JobState"] == "PENDING", job_log.read_text()
    slurm_cluster.command("scontrol", "update", f"JobId={job}", "StartTime=now")
    final = slurm_cluster.wait(job, timeout=600)
    log = job_log.read_text() + "\n" + (run_dir / "runner.log").read_text()
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", log
    assert f"SLURM job {job} requeues itself: it continues this run" in log, log
    stopped_at = int(log.split("SIGTERM: stopped at step ")[1].split()[0])
    assert 25 <= stopped_at < 400 and f"resuming at step {stopped_at} " in log, log
    _assert_as_reference(run_dir, tmp_path / "signalled.db", two_node_reference)


@pytest.mark.slow
def test_a_two_node_job_that_loses_a_node_ends_in_one_line_and_its_resume_finishes_as_if_never_stopped(
        slurm_cluster: SlurmCluster, tmp_path: Path, migrated_mlflow_store: Path, two_node_reference) -> None:
    """node2's task (its launcher and worker) SIGKILLed mid-training, as a node that goes down: node 0 ends the
    job with one line naming the lost node, the step whose checkpoint is kept and the resume; the job ends
    FAILED (not requeued: a lost node is not a preemption), and the resume the line gives, submitted on two
    nodes, ends with the weights and metrics of an uninterrupted job."""
    job, run_dir, job_log = _submit_two_nodes(slurm_cluster, tmp_path, "lost", migrated_mlflow_store)
    _wait_for("the job's first checkpoint", lambda: any((run_dir / "checkpoints").glob("step-*.pt")), 600, job_log)
    victims = _job_processes(job, 1)
    assert victims, job_log.read_text()
    for pid in victims:
        os.kill(pid, 9)
    final = slurm_cluster.wait(job, timeout=300)
    log = job_log.read_text()
    lines = [line for line in log.splitlines() if line.startswith("runner: node 1 of 2 ")]
    assert final["JobState"] == "FAILED" and final["Restarts"] == "0", log
    assert len(lines) == 1 and " was lost after step " in lines[0], log
    assert f"trainer.resume={run_dir}" in lines[0] and "Traceback" not in log, log
    step = int(lines[0].split(" was lost after step ")[1].split()[0])
    assert (run_dir / "checkpoints" / f"step-{step:08d}.pt").exists()
    resumed, _, resumed_log = _submit_two_nodes(slurm_cluster, tmp_path, "lost", migrated_mlflow_store,
                                                f"trainer.resume={run_dir}", log_name="resumed")
    final = slurm_cluster.wait(resumed, timeout=600)
    assert final["JobState"] == "COMPLETED", resumed_log.read_text()
    _assert_as_reference(run_dir, tmp_path / "lost.db", two_node_reference)


# --- hydra/launcher=slurm ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_slurm_launcher_defaults_run_on_a_cpu_partition_and_a_refusal_is_one_line(
        slurm_cluster: SlurmCluster, tmp_path: Path, migrated_mlflow_store: Path) -> None:
    """`hydra/launcher=slurm` as shipped asks nothing a CPU partition lacks (it asked 8 GPUs per node: a
    30-line sbatch traceback): its job trains and ends FINISHED. Asking for GPUs the partition does not
    have is one line naming what was asked and the keys to set, exit 2, and leaves no parent run behind."""
    from mlflow.tracking import MlflowClient

    store = _store(tmp_path, "mlflow", migrated_mlflow_store)
    base = [sys.executable, "-m", "runner", "-m", "hydra/launcher=slurm", "trainer.max_steps=3", "trainer.progress_bar=off",
            "trainer.memory_estimate=false", "trainer.device=cpu", *store]
    ran = subprocess.run(base, cwd=tmp_path, env=_job_env(slurm_cluster), capture_output=True, text=True, timeout=400)
    assert ran.returncode == 0, ran.stderr[-3000:]
    client = MlflowClient(store[0].split("=", 1)[1])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert [r.info.status for r in children] == ["FINISHED"] and children[0].data.metrics["train/loss"] > 0

    refused = subprocess.run([*base, "hydra.launcher.gpus_per_node=8"], cwd=tmp_path, env=_job_env(slurm_cluster),
                             capture_output=True, text=True, timeout=400)
    assert refused.returncode == 2
    assert "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: hydra/launcher=slurm: sbatch refused the job (Invalid generic resource (gres) specification); it "
        "asked nodes=1, tasks_per_node=1, gpus_per_node=8, timeout_min=240: set hydra.launcher.partition, "
        "hydra.launcher.gpus_per_node, hydra.launcher.cpus_per_task and hydra.launcher.mem_gb to what the partition "
        "has (sinfo -o '%P %D %c %m %G' lists them)")
    # the refused multirun's parent run, opened before the submission, used to stay behind FAILED with no child:
    # nothing ran, so nothing of it is left (the first multirun's parent and child are all the store holds)
    after = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.info.run_id for r in after) == sorted(r.info.run_id for r in runs)
    assert sorted(r.info.status for r in after) == ["FINISHED", "FINISHED"]
