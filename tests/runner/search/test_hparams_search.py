"""`python -m runner -m hparams_search=...`: trials that report, get pruned, fail, run in parallel and
die with their sweep, read back from the Optuna study and from MLflow (parent run, child per trial)."""
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from runner.tracking.mlflow_store import open_client
from runner.search.trial import PRUNER_ATTR, RUN_DIR_ATTR, open_storage
from tests.conftest import run_cli
from tests.runner.engine.test_engine import ctrl_c_during_step, tracked
from tests.runner.engine.test_parallel import metric_history
from tests.process_tree import alive, descendants


def load(journal: Path, name: str = "digits_optuna") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(str(journal)))


def runs(uri: str) -> tuple:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("runner").experiment_id
    found = client.search_runs([experiment])
    parents = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def run_of(trial: optuna.trial.FrozenTrial) -> str:
    """A trial's MLflow run id: its job wrote its run directory into the trial."""
    return (Path(trial.system_attrs[RUN_DIR_ATTR]) / "mlflow_run_id").read_text().strip()


@pytest.mark.slow
def test_a_study_prunes_fails_resumes_and_reads_back_as_parent_and_children(tmp_path: Path) -> None:
    uri, journal = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "study.journal"
    # the order matters to the pruner, so it is fixed: enqueued trials run first, in order
    study = optuna.create_study(study_name="digits_optuna", storage=open_storage(str(journal)), direction="maximize")
    for lr in (0.05, 1e6, 1e-5):  # learns; diverges (FAIL); behind the first at epoch 1 (PRUNED)
        study.enqueue_trial({"optimizer.lr": lr})
    args = ["-m", "hparams_search=digits_optuna", f"hydra.sweeper.storage={journal}", "hydra.sweeper.n_trials=3",
            "hydra.sweeper.max_failure_rate=0.5", "hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=1",
            "optimizer=sgd", "optimizer.lr=choice(0.05, 0.00001, 1000000.0)", "optimizer.weight_decay=0",
            "scheduler=constant", "dataset.batch_size=64", "trainer.max_epochs=3", f"tracking.uri={uri}"]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = load(journal).trials
    assert [(t.params["optimizer.lr"], t.state) for t in trials] == [
        (0.05, TrialState.COMPLETE), (1e6, TrialState.FAIL), (1e-5, TrialState.PRUNED)]
    assert list(trials[2].intermediate_values) == [1]  # stopped at its first evaluation (epoch 1, step 20)
    assert "Traceback" not in proc.stdout + proc.stderr  # the failure is one line; its traceback is in its job log
    assert "trial.storage" not in proc.stdout + proc.stderr  # job lines show the user's overrides only
    assert (proc.stdout + proc.stderr).count("trial 2 pruned at epoch 1 (step 20): val/acc ") == 1
    table = proc.stdout[proc.stdout.index("runner: 3 jobs in "):].splitlines()
    assert [line.lstrip("* ").split()[0:2] for line in table[2:5]] == [
        ["0", "optimizer.lr=0.05"], ["1", "optimizer.lr=1000000.0"], ["2", "optimizer.lr=1e-05"]]
    assert table[2].startswith("*") and f"{trials[0].value:.4f}" in table[2] and "complete" in table[2]
    assert table[3].split()[-4:-2] == ["-", "fail"] and table[4].split()[-4:-2] == ["-", "pruned"]
    # the diverged trial's job log says why it failed (runner's Diverged: the loss stopped being finite)
    assert "the loss is not finite" in (Path(trials[1].system_attrs[RUN_DIR_ATTR]) / "runner.log").read_text()
    (results_file,) = tmp_path.glob("outputs/multiruns/*/*/optimization_results.yaml")
    results = yaml.safe_load(results_file.read_text())
    assert results["best_params"]["optimizer.lr"] == 0.05 and results["best_value"] == trials[0].value
    assert results["trials"] == {"COMPLETE": 1, "PRUNED": 1, "FAIL": 1}

    client, (parent,), children = runs(uri)
    assert parent.info.status == "FINISHED" and parent.info.run_name == "digits_optuna"
    assert parent.data.params["search_space.optimizer.lr"] == "choice(0.05, 1e-05, 1000000.0)"
    assert parent.data.params["pruner"].startswith("MedianPruner(")
    assert parent.data.tags["best_trial"] == "0" and parent.data.metrics["best_value"] == trials[0].value
    assert (parent.data.metrics["trials_complete"], parent.data.metrics["trials_pruned"], parent.data.metrics["trials_fail"]) == (1, 1, 1)
    assert [(m.step, m.value) for m in client.get_metric_history(parent.info.run_id, "trial_value")] == [(0, trials[0].value)]
    assert {"optimization_results.yaml", "jobs.csv"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert table[5].endswith(f"/runs/{parent.info.run_id}?workflowType=machine_learning")
    by_trial = {int(r.data.tags["optuna.trial"]): r for r in children}
    assert {n: run_of(t) for n, t in enumerate(trials)} == {n: r.info.run_id for n, r in by_trial.items()}
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    assert [(by_trial[n].info.status, by_trial[n].data.tags["optuna.state"]) for n in range(3)] == [
        ("FINISHED", "COMPLETE"), ("FAILED", "FAIL"), ("FINISHED", "PRUNED")]
    assert by_trial[2].data.tags["pruned"] == "true"  # the engine's mark; the sweeper agrees: optuna.state PRUNED
    assert [by_trial[n].data.tags["optuna.best"] for n in range(3)] == ["true", "false", "false"]

    again = run_cli(args, cwd=tmp_path)  # the same command resumes: n_trials are done, nothing new runs
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(load(journal).trials) == 3
    _, (parent_again,), children_again = runs(uri)
    assert parent_again.info.run_id == parent.info.run_id and len(children_again) == 3


@pytest.mark.usefixtures("store")  # its tmp_path/mlflow.db comes migrated (tests/conftest.py): seconds saved
def test_a_resumed_trial_reports_at_its_optimizer_steps(tmp_path: Path) -> None:
    """A trial interrupted after its checkpoint of step 20 and resumed: its intermediate values are its
    validations at their optimizer steps, those after the resume included (Optuna ignores a step it has
    seen, so a count restarting at 0 would hand the pruner stale values)."""
    journal = tmp_path / "study.journal"
    study = optuna.create_study(study_name="s", storage=open_storage(str(journal)), direction="maximize")
    study.set_user_attr(PRUNER_ATTR, {"_target_": "optuna.pruners.NopPruner"})
    number = study.ask().number
    run = ["trainer.max_steps=30", "trainer.eval_every_n_steps=10", "trainer.checkpoint_every_n_steps=10",
           "model.hidden=[16]", "trainer.eval_every_epoch=false", "trainer.progress_bar=off",
           f"trial.storage={journal}", "trial.study_name=s", f"trial.number={number}"]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cut = ctrl_c_during_step(tracked(run, tmp_path / "run", uri), 25)
    with pytest.raises(KeyboardInterrupt):
        cut.fit()
    tracked([*run, f"trainer.resume={tmp_path / 'run'}"], tmp_path / "run", uri).fit()
    val_acc = metric_history(tmp_path / "mlflow.db")["val/acc"]
    assert [s for s, _ in val_acc] == [10, 20, 30]
    assert load(journal, "s").trials[number].intermediate_values == dict(val_acc)


@pytest.mark.slow
def test_two_parallel_slots_on_the_default_stores_lose_no_trial_and_no_metric(tmp_path: Path) -> None:
    proc = run_cli(["-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
                    "hydra/sweeper/pruner=none", "trainer.max_epochs=2", "trainer.log_every_n_steps=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (journal,) = tmp_path.glob("outputs/multiruns/*/*/optuna.journal")  # storage: null, a new study in the sweep dir
    trials = {t.number: t for t in load(journal).trials}
    assert [t.state for t in trials.values()] == [TrialState.COMPLETE] * 4
    assert trials[1].datetime_start < trials[0].datetime_complete  # two slots ran at once

    client, (parent,), children = runs(f"sqlite:///{tmp_path}/outputs/mlflow.db")  # the default local store
    assert len(children) == 4 and {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    for run in children:
        trial = trials[int(run.data.tags["optuna.trial"])]
        val_acc = client.get_metric_history(run.info.run_id, "val/acc")
        assert [m.value for m in sorted(val_acc, key=lambda m: m.step)] == list(trial.intermediate_values.values())
        steps = {m.step for m in client.get_metric_history(run.info.run_id, "train/loss")}
        last = max(m.step for m in val_acc)  # the last evaluation ends the last epoch
        assert steps == set(range(1, last + 1))  # train/loss at every optimizer step: none lost
        assert run.info.status == "FINISHED" and "test/acc" in run.data.metrics


@pytest.mark.slow
@pytest.mark.parametrize("metric, direction", [("val/loss", "minimize"), ("val/acc", "maximize")])
def test_a_study_without_a_direction_takes_the_objectives(tmp_path: Path, metric: str, direction: str) -> None:
    """The objective's direction: the task's declaration for objective.metric (a typed one must agree with it)."""
    proc = run_cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "optimizer.lr=interval(0.01, 0.1)",
                    f"objective.metric={metric}", "trainer.max_epochs=1", "tracking=none"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (journal,) = tmp_path.glob("outputs/multiruns/*/*/optuna.journal")
    (name,) = [s.study_name for s in optuna.get_all_study_summaries(open_storage(str(journal)))]
    assert load(journal, name).direction.name == direction.upper()


@pytest.mark.slow
def test_the_preset_study_minimizes_a_val_loss_objective(tmp_path: Path) -> None:
    """hparams_search=digits_optuna sets the study's direction from the objective: with val/loss that is the
    task's minimize (it was maximize, the preset's val/acc default), read back from the study's storage."""
    proc = run_cli(["-m", "hparams_search=digits_optuna", "objective.metric=val/loss", "hydra.sweeper.n_trials=1",
                    "trainer.max_epochs=1", "tracking=none"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (journal,) = tmp_path.glob("outputs/multiruns/*/*/optuna.journal")
    assert load(journal).direction.name == "MINIMIZE"


@pytest.mark.slow
def test_a_grid_marks_the_job_with_the_lowest_val_loss_best(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = run_cli(["-m", "optimizer.lr=0.0001,0.003,0.3", "objective.metric=val/loss", "trainer.max_steps=20",
                    "trainer.eval_every_n_steps=10", "trainer.eval_every_epoch=false", f"tracking.uri={uri}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, (parent,), children = runs(uri)
    objective = {r.info.run_id: r.data.metrics["objective"] for r in children}
    assert objective == {r.info.run_id: r.data.metrics["best_val_loss"] for r in children}
    assert len(set(objective.values())) == 3  # the three learning rates end apart
    (best,) = [r.info.run_id for r in children if r.data.tags["runner.best"] == "true"]
    assert objective[best] == min(objective.values())
    assert parent.data.metrics["best_value"] == min(objective.values())


@pytest.mark.slow
def test_a_grid_multirun_is_a_parent_run_with_a_child_per_job(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = run_cli(["-m", "optimizer=sgd,adamw", "precision=fp32,bf16", "trainer.max_epochs=1", f"tracking.uri={uri}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, (parent,), children = runs(uri)
    assert parent.info.status == "FINISHED" and parent.data.tags["runner.sweeper"] == "basic"
    assert sorted(r.info.run_name for r in children) == ["adamw,bf16,max_epochs=1", "adamw,fp32,max_epochs=1",
                                                         "sgd,bf16,max_epochs=1", "sgd,fp32,max_epochs=1"]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    # as a study's parent: the best child tagged, best_value, every child's params and objective in jobs.csv
    objective = {r.info.run_id: r.data.metrics["objective"] for r in children}
    flags = {r.info.run_id: r.data.tags["runner.best"] for r in children}
    assert sorted(flags.values()) == ["false", "false", "false", "true"]
    best_id = next(i for i, flag in flags.items() if flag == "true")
    assert objective[best_id] == max(objective.values())  # jobs may tie: one of the best is marked
    assert parent.data.metrics["best_value"] == objective[best_id]
    client = MlflowClient(uri)
    with open(client.download_artifacts(parent.info.run_id, "jobs.csv", str(tmp_path))) as f:
        rows = list(csv.DictReader(f))
    assert {(r["optimizer"], r["precision"], float(r["val/acc"]), r["status"]) for r in rows} == {
        (*r.info.run_name.split(",")[:2], objective[r.info.run_id], "complete") for r in children}
    # the console ends with the table: one line per job, its swept overrides, the best marked, the parent's link
    table = proc.stdout[proc.stdout.index("runner: 4 jobs in "):].splitlines()
    assert table[1].split() == ["#", "overrides", "val/acc", "status", "time"]
    by_job = {line.lstrip("* ").split()[0]: line for line in table[2:6]}
    assert sorted(line.startswith("*") for line in table[2:6]) == [False, False, False, True]
    best_row = next(r for r in rows if r["run_id"] == best_id)
    assert by_job[best_row["job"]].startswith("*") and f"{objective[best_id]:.4f}" in by_job[best_row["job"]]
    assert f"optimizer={best_row['optimizer']} precision={best_row['precision']} " in by_job[best_row["job"]]
    assert table[6].startswith("parent MLflow run: ") and table[6].endswith(
        f"/runs/{parent.info.run_id}?workflowType=machine_learning")
    for job_dir in tmp_path.glob("outputs/multiruns/*/*/[0-3]"):  # every job's run log, summary included
        assert "runner: trained" in (job_dir / "runner.log").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_sweep_takes_its_trials_along_and_study_and_mlflow_agree(tmp_path: Path) -> None:
    """SIGKILL of a 2-slot sweep: its trials stop (no FINISHED MLflow run appears later), the next
    open of the store ends the parent's and the trials' MLflow runs KILLED, and the next sweep on the
    study fails the trials."""
    uri, journal = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "study.journal"
    args = [sys.executable, "-m", "runner", "-m", "hparams_search=digits_optuna", f"hydra.sweeper.storage={journal}",
            "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", "hydra.sweeper.heartbeat_interval=1",
            "hydra/sweeper/pruner=none", "trainer.max_epochs=1000", f"tracking.uri={uri}"]
    sweep = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 240
        while len(list(tmp_path.glob("outputs/multiruns/*/*/*/mlflow_run_id"))) < 2 and time.time() < deadline:
            time.sleep(0.5)
        assert len(list(tmp_path.glob("outputs/multiruns/*/*/*/mlflow_run_id"))) == 2, "the trials never started"
        below = descendants(sweep.pid)
        sweep.kill()
        sweep.wait()
        deadline = time.time() + 30
        while any(alive(p) for p in below) and time.time() < deadline:
            time.sleep(0.5)
        assert not [p for p in below if alive(p)], "trial processes outlived their sweep"
    finally:
        for pid in descendants(sweep.pid) if sweep.poll() is None else ():
            os.kill(pid, 9)
    assert [t.state for t in load(journal).trials] == [TrialState.RUNNING] * 2  # the sweep told nothing
    open_client(uri)  # what any runner command does first: the runs whose process is gone end KILLED
    _, parents, children = runs(uri)
    assert len(children) == 2 and [r.info.status for r in parents + children] == ["KILLED"] * 3

    again = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    trials = load(journal).trials
    assert [t.state for t in trials] == [TrialState.FAIL] * 2  # stale: failed by the next sweep, which ran nothing new
    client = MlflowClient(uri)
    for t in trials:
        run = client.get_run(run_of(t))
        assert run.info.status == "KILLED" and run.data.tags["optuna.state"] == "FAIL"
