"""Multiruns under Hydra's joblib and submitit_local launchers, which run each job in a process of its own
(a reused joblib worker, a submitit subprocess): the grid's summary (jobs.csv, the best marked, the parent
MLflow run with its children) is whole, read back from the store, and the console holds no SQL and no
runner-internal overrides."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import run_cli
from tests.runner.search.test_hparams_search import runs

SHORT = ["trainer.max_steps=20", "trainer.eval_every_n_steps=10", "trainer.eval_every_epoch=false",
         "trainer.progress_bar=off"]
LRS = ("0.001", "0.01", "0.1")


def launcher_args(launcher: str) -> list[str]:
    pytest.importorskip({"joblib": "hydra_plugins.hydra_joblib_launcher",
                         "submitit_local": "hydra_plugins.hydra_submitit_launcher"}[launcher],
                        reason=f"Hydra's {launcher} launcher is not installed (pip install runner[cluster])")
    # joblib: 2 workers for 3 jobs, so one worker runs a second job (a process reused across jobs)
    return ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"] if launcher == "joblib" else ["hydra/launcher=submitit_local"]


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_a_grid_under_a_launcher_of_its_own_processes_keeps_its_whole_summary(tmp_path: Path, launcher: str,
                                                                              store: str) -> None:
    proc = run_cli(["-m", f"optimizer.lr={','.join(LRS)}", *SHORT, f"tracking.uri={store}", *launcher_args(launcher)],
                   cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, parents, children = runs(store)
    (parent,) = parents
    assert parent.info.status == "FINISHED" and len(children) == 3
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    objective = {r.info.run_id: r.data.metrics["objective"] for r in children}
    flags = {r.info.run_id: r.data.tags.get("runner.best") for r in children}
    assert sorted(flags.values()) == ["false", "false", "true"]  # every child marked, one of them best
    best_id = next(i for i, flag in flags.items() if flag == "true")
    assert objective[best_id] == max(objective.values())
    assert parent.data.metrics["best_value"] == objective[best_id]
    (sweep_dir,) = tmp_path.glob("outputs/multiruns/*/*")
    stored = MlflowClient(store).download_artifacts(parent.info.run_id, "jobs.csv", str(tmp_path))
    for path in (sweep_dir / "jobs.csv", Path(stored)):  # the sweep directory's copy and the parent's artifact
        with open(path) as f:
            rows = list(csv.DictReader(f))
        assert sorted((r["optimizer.lr"], float(r["val/acc"]), r["status"], r["run_id"]) for r in rows) == sorted(
            (r.data.params["optimizer.lr"], objective[r.info.run_id], "complete", r.info.run_id) for r in children)
        assert all(float(r["seconds"]) > 0 for r in rows)
    table = proc.stdout[proc.stdout.index("runner: 3 jobs in "):].splitlines()
    assert f"(* best val/acc: {objective[best_id]:.4f})" in table[0]
    marked = [line for line in table[2:5] if line.startswith("*")]
    assert len(marked) == 1 and f"{objective[best_id]:.4f}" in marked[0]
    assert table[5].startswith("parent MLflow run: ") and f"/runs/{parent.info.run_id}?" in table[5]


@pytest.mark.slow
@pytest.mark.cluster
def test_an_optuna_study_under_joblib_prints_no_sql_and_no_internal_overrides(tmp_path: Path, store: str) -> None:
    # 2 slots, 2 joblib workers, 4 trials: the third and fourth trials run in reused workers
    proc = run_cli(["-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2", *SHORT,
                    f"tracking.uri={store}", *launcher_args("joblib")], cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "sqlalchemy" not in console
    job_lines = [line for line in console.splitlines() if re.search(r"\t#\d+ : ", line)]
    assert len(job_lines) == 4, console[-3000:]
    assert not any("trial." in line for line in job_lines), job_lines
    assert all("optimizer.lr=" in line for line in job_lines)  # the sampled values stay
    assert "runner: 4 jobs in " in proc.stdout
    _, (parent,), children = runs(store)
    assert len(children) == 4 and parent.data.metrics["trials_complete"] == 4


# SQLAlchemy's statement log as the console shows it (runner's console format is the message alone)
_SQL_LINE = re.compile(r"^(BEGIN \(implicit\)|COMMIT|ROLLBACK|SELECT |INSERT |UPDATE |DELETE |PRAGMA |FROM |WHERE |"
                       r"\[(raw sql|generated in|cached since|no key))")


@pytest.mark.slow  # a minute: each loky worker imports torch and runner (the cause has a fast test in test_process_state)
@pytest.mark.cluster
def test_a_study_in_a_sqlite_storage_under_joblib_prints_no_sql(tmp_path: Path) -> None:
    """Issue 35 item 12: with the joblib launcher and a sqlite study storage, 204 of 279 console lines were
    SQLAlchemy's statements: the worker's first job imported SQLAlchemy (its trial opens the storage), and the
    job's end put every logger made meanwhile to NOTSET, SQLAlchemy's own WARNING included, so the worker's
    next job logged each statement under the INFO root. Two workers, three trials: one worker runs two."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="Hydra's joblib launcher is not installed")
    proc = run_cli(["-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=3", "hydra/launcher=joblib",
                    "hydra.launcher.n_jobs=2", f"hydra.sweeper.storage=sqlite:///{tmp_path / 'optuna.db'}",
                    "trainer.max_steps=2", "trainer.progress_bar=off", "tracking=none",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    assert "runner: 3 jobs in " in proc.stdout  # every trial ran, and said so
    assert [line for line in console if _SQL_LINE.match(line)] == [], f"{len(console)} console lines"
