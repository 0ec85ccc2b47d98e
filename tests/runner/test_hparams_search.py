"""`python -m runner -m hparams_search=...`: trials that report, get pruned, fail and run in parallel,
read back from the Optuna study and from MLflow (parent run, child per trial)."""
from pathlib import Path

import optuna
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from runner.trial import open_storage
from tests.conftest import run_cli


def study_trials(cwd: Path, name: str = "digits_optuna") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=open_storage(str(cwd / "outputs" / "optuna.journal"))).trials


def runs(uri: str) -> tuple:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("runner").experiment_id
    found = client.search_runs([experiment])
    parents = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def test_a_study_prunes_fails_resumes_and_reads_back_as_parent_and_children(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    # grid order with seed 1: lr 0.05 (learns), lr 1e6 (diverges: FAIL), lr 1e-5 (behind the median: PRUNED)
    args = ["-m", "hparams_search=digits_optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.sampler.seed=1",
            "hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=1",
            "optimizer=sgd", "optimizer.lr=choice(0.05, 0.00001, 1000000.0)", "optimizer.weight_decay=0",
            "scheduler=constant", "dataset.batch_size=64", "trainer.max_epochs=3", f"tracking.uri={uri}"]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = study_trials(tmp_path)
    assert [(t.params["optimizer.lr"], t.state) for t in trials] == [
        (0.05, TrialState.COMPLETE), (1e6, TrialState.FAIL), (1e-5, TrialState.PRUNED)]
    assert list(trials[2].intermediate_values) == [1]  # stopped at its first evaluation
    (results_file,) = tmp_path.glob("outputs/multiruns/*/*/optimization_results.yaml")
    results = yaml.safe_load(results_file.read_text())
    assert results["best_params"]["optimizer.lr"] == 0.05 and results["best_value"] == trials[0].value

    client, (parent,), children = runs(uri)
    assert parent.info.status == "FINISHED" and parent.info.run_name == "digits_optuna"
    assert parent.data.params["search_space.optimizer.lr"] == "choice(0.05, 1e-05, 1000000.0)"
    assert parent.data.params["sampler"] == "GridSampler(seed=1)" and parent.data.params["pruner"].startswith("MedianPruner(")
    assert parent.data.tags["best_trial"] == "0" and parent.data.metrics["trials_pruned"] == 1
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"optimization_history.png", "optimization_results.yaml"} <= artifacts
    by_trial = {int(r.data.tags["optuna.trial"]): r for r in children}
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    assert [(by_trial[n].info.status, by_trial[n].data.tags["optuna.state"]) for n in range(3)] == [
        ("FINISHED", "COMPLETE"), ("FAILED", "FAIL"), ("FINISHED", "PRUNED")]
    assert by_trial[2].data.tags["pruned"] == "true" and by_trial[0].data.tags["optuna.best"] == "true"

    again = run_cli(args, cwd=tmp_path)  # the same command resumes: the grid is done, nothing new runs
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(study_trials(tmp_path)) == 3
    _, (parent_again,), children_again = runs(uri)
    assert parent_again.info.run_id == parent.info.run_id and len(children_again) == 3


def test_two_parallel_slots_on_the_default_stores_lose_no_trial_and_no_metric(tmp_path: Path) -> None:
    proc = run_cli(["-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
                    "hydra/sweeper/pruner=none", "trainer.max_epochs=2", "trainer.log_every_n_steps=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = {t.number: t for t in study_trials(tmp_path)}
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
