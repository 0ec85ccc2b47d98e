"""k-fold cross-validation (runner/search/folds.py, runner/search/cross_validation.py): the folds partition train+val and
keep the test split, classification folds keep the class proportions, a K-fold run is one MLflow parent
with a child per fold and returns the folds' mean (to a study too, with the running mean as the trial's
intermediate values), and a K-fold run stopped in a fold resumes at that fold."""
from __future__ import annotations

import sqlite3
import subprocess
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.specs import components

from runner.search import folds

from runner.cli import launch
from runner.search.cross_validation import RECORD, read_record
from runner.engine.engine import Engine
from runner.specs.run import RunSpec
from tests.conftest import compose_spec, run_cli

TINY = ["trainer.max_steps=3", "trainer.progress_bar=off", "trainer.memory_estimate=false", "trainer.test_on=last"]
METRIC = "val/acc"


def runs(db: Path) -> dict[str, dict]:
    """MLflow's runs: id -> name, status, parent, metrics (key -> [(step, value)]), tags."""
    with sqlite3.connect(db) as con:
        out = {rid: {"name": name, "status": status, "metrics": {}, "tags": {}}
               for rid, name, status in con.execute("select run_uuid, name, status from runs")}
        for rid, key, value in con.execute("select run_uuid, key, value from tags"):
            out[rid]["tags"][key] = value
        for rid, key, step, value in con.execute("select run_uuid, key, step, value from metrics order by step"):
            out[rid]["metrics"].setdefault(key, []).append((step, value))
    for run in out.values():
        run["parent"] = run["tags"].get("mlflow.parentRunId")
    return out


def children(db: Path, parent: str) -> list[dict]:
    """The fold runs under a K-fold run, by fold."""
    kids = [r for r in runs(db).values() if r["parent"] == parent]
    return sorted(kids, key=lambda r: r["metrics"]["cv/fold"][0][1])


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory):
    spec = compose_spec([], tmp_path_factory.mktemp("digits") / "run")
    return components.build_data(spec)


@pytest.mark.parametrize("k", [2, 5])
def test_the_folds_partition_train_and_val_and_leave_test_alone(digits, k: int) -> None:
    pool, labels = folds.pool_of(digits)
    assert len(pool) == len(digits.train) + len(digits.val)
    x, y = pool.tensors
    parts = folds.fold_indices(labels, len(pool), k, seed=3)
    assert len(parts) == k
    every = np.concatenate(parts)
    assert len(every) == len(np.unique(every)) == len(pool)  # disjoint, and together all of train+val
    assert sorted(every.tolist()) == list(range(len(pool)))
    for fold, val_idx in enumerate(parts):
        data = folds.fold_data(digits, k, fold, seed=3)
        train_idx = np.setdiff1d(np.arange(len(pool)), val_idx)
        assert torch.equal(data.val.tensors[0], x[val_idx]) and torch.equal(data.val.tensors[1], y[val_idx])
        assert torch.equal(data.train.tensors[0], x[train_idx]) and torch.equal(data.train.tensors[1], y[train_idx])
        assert data.test is digits.test  # every fold tests on the same samples
    # the fold seed decides the folds (and only it): another seed, other folds; the same seed, the same ones
    assert [p.tolist() for p in folds.fold_indices(labels, len(pool), k, seed=3)] == [p.tolist() for p in parts]
    assert [p.tolist() for p in folds.fold_indices(labels, len(pool), k, seed=4)] != [p.tolist() for p in parts]


def test_classification_folds_keep_the_class_proportions_within_one_sample(digits) -> None:
    pool, labels = folds.pool_of(digits)
    parts = folds.fold_indices(labels, len(pool), 7, seed=0)
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])  # fold x class
    assert (counts.max(0) - counts.min(0)).max() <= 1
    # the plain folds a regression or language-model task gets do not: the same sizes, uneven classes
    plain = folds.fold_indices(None, len(pool), 7, seed=0)
    assert [len(p) for p in plain] == [len(p) for p in parts]
    assert np.ptp(np.stack([np.bincount(labels[p], minlength=10) for p in plain]), axis=0).max() > 1


def test_regression_folds_are_plain_and_augmented_train_splits_are_refused() -> None:
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from runner.data.images import AugmentedImages
    from runner.specs.fields import SpecError

    x, y = torch.randn(30, 4), torch.randn(30)  # float targets: no classes to stratify by
    data = SimpleNamespace(train=TensorDataset(x[:20], y[:20]), val=TensorDataset(x[20:], y[20:]), num_classes=None)
    assert folds.plan(data, 4, seed=0) == (30, [8, 8, 7, 7], False)
    with pytest.raises(SpecError, match=r"^trainer.cross_validation.folds: 31 is more than the 30 samples of train\+val"):
        folds.plan(data, 31, seed=0)
    images, labels = torch.zeros(30, 3, 4, 4, dtype=torch.uint8), torch.arange(30) % 3
    augmented = SimpleNamespace(train=AugmentedImages(images[:20], labels[:20], lambda t: t),
                                val=TensorDataset(images[20:].float(), labels[20:]), num_classes=3)
    with pytest.raises(SpecError, match="read samples differently .AugmentedImages with function and TensorDataset"):
        folds.plan(augmented, 3, seed=0)


def test_a_fold_run_builds_its_fold_through_the_spec(digits, tmp_path: Path) -> None:
    spec = compose_spec(["trainer.cross_validation.folds=4", "trainer.cross_validation.fold=2",
                         "trainer.cross_validation.seed=9"], tmp_path / "run")
    data = components.build_data(spec)
    expected = folds.fold_data(digits, 4, 2, seed=9)
    assert torch.equal(data.val.tensors[0], expected.val.tensors[0])
    assert torch.equal(data.train.tensors[1], expected.train.tensors[1])
    assert torch.equal(data.test.tensors[0], digits.test.tensors[0])


def test_a_k_fold_trial_is_a_parent_run_with_a_child_per_fold_and_the_study_sees_their_mean(store: str,
                                                                                             tmp_path: Path) -> None:
    """The job of an Optuna trial (what the sweeper starts) with 2 folds: one MLflow parent, a child per fold;
    the trial's value is the mean of the children's objectives read back from MLflow, the running means are
    its intermediate values at step = fold; a pruner stops the next trial before its second fold."""
    import optuna

    from runner.search.trial import PRUNER_ATTR, open_storage

    journal = tmp_path / "study.journal"
    study = optuna.create_study(study_name="cv", storage=open_storage(str(journal)), direction="maximize")
    db = Path(store.removeprefix("sqlite:///"))

    def job(name: str) -> tuple[optuna.trial.FrozenTrial, str]:
        trial = study.ask()
        spec = compose_spec([*TINY, "trainer.cross_validation.folds=2", f"trial.storage={journal}",
                             "trial.study_name=cv", f"trial.number={trial.number}"], tmp_path / name, tracking_uri=store)
        try:
            study.tell(trial, launch.run(spec).objective)
        except optuna.TrialPruned:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return study.trials[trial.number], (tmp_path / name / "mlflow_run_id").read_text().strip()

    done, parent_id = job("complete")
    kids, parent = children(db, parent_id), runs(db)[parent_id]
    assert [k["metrics"]["cv/fold"] for k in kids] == [[(0, 0.0)], [(0, 1.0)]]
    assert all(k["status"] == "FINISHED" and k["name"].endswith(f"fold={i}") for i, k in enumerate(kids))
    assert parent["status"] == "FINISHED" and parent["parent"] is None
    assert sorted(p.name for p in (tmp_path / "complete").iterdir() if p.name.startswith("fold-")) == ["fold-0", "fold-1"]
    objectives = [k["metrics"]["objective"][-1][1] for k in kids]  # each fold's best val/acc, as it logged it
    assert parent["metrics"][f"cv/{METRIC}"] == [(0, pytest.approx(objectives[0])), (1, pytest.approx(objectives[1]))]
    assert parent["metrics"][f"cv/{METRIC}_mean"][0][1] == pytest.approx(statistics.fmean(objectives))
    assert parent["metrics"][f"cv/{METRIC}_std"][0][1] == pytest.approx(statistics.pstdev(objectives))
    assert parent["metrics"]["objective"][0][1] == pytest.approx(statistics.fmean(objectives))
    # each fold tested on the one test split: the parent's mean test accuracy is the children's mean
    tests = [k["metrics"]["test/acc"][-1][1] for k in kids]
    assert parent["metrics"]["cv/test/acc_mean"][0][1] == pytest.approx(statistics.fmean(tests))
    assert done.state == optuna.trial.TrialState.COMPLETE
    assert done.value == pytest.approx(statistics.fmean(objectives), abs=1e-12)
    assert done.intermediate_values == pytest.approx({0: objectives[0], 1: statistics.fmean(objectives)})
    assert done.user_attrs[f"cv/{METRIC}_std"] == pytest.approx(statistics.pstdev(objectives))

    study.set_user_attr(PRUNER_ATTR, {"_target_": "optuna.pruners.ThresholdPruner", "lower": 1.01})
    cut, parent_id = job("pruned")
    assert cut.state == optuna.trial.TrialState.PRUNED and list(cut.intermediate_values) == [0]
    assert len(children(db, parent_id)) == 1  # fold 1 never ran
    assert runs(db)[parent_id]["tags"]["runner.outcome"] == "pruned"
    assert runs(db)[parent_id]["status"] == "FINISHED"


def test_a_k_fold_run_stopped_in_a_fold_resumes_at_that_fold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without MLflow, to stay cheap: the MLflow side of a resume is every run's (tests/runner/engine/test_resume.py)."""
    run_dir = tmp_path / "cv"
    overrides = [*TINY, "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2", "trainer.cross_validation.folds=2"]
    steps: list[tuple[str, int]] = []  # (fold run directory, step) of every optimizer step taken
    train_step, stop = Engine.train_step, [True]

    def counted(self, micro_batches):
        steps.append((Path(self.spec.run_dir).name, self.progress.step + 1))
        if steps[-1] == ("fold-1", 3) and stop:  # Ctrl-C in fold 1's step 3, after its step-2 checkpoint
            stop.clear()
            raise KeyboardInterrupt
        return train_step(self, micro_batches)

    monkeypatch.setattr(Engine, "train_step", counted)
    with pytest.raises(KeyboardInterrupt):
        launch.run(compose_spec(overrides, run_dir))
    assert list(read_record(run_dir)) == [0]
    fold_0 = read_record(run_dir)[0]

    steps.clear()
    result = launch.run(compose_spec([f"trainer.resume={run_dir}"], tmp_path / "unused"))
    assert steps == [("fold-1", 3), ("fold-1", 4)]  # fold 0 not again; fold 1 from its step-2 checkpoint
    record = read_record(run_dir)
    assert sorted(record) == [0, 1] and record[0] == fold_0 and (run_dir / RECORD).is_file()
    assert record[1]["steps"] == 4
    assert result.objective == statistics.fmean([record[0]["objective"], record[1]["objective"]])


# --- from the command line, as a user runs it (slow: real processes; the fast tests above keep each
# property in CI: the study's mean and parent/child runs in-process, the resume with Ctrl-C in-process)

@pytest.mark.slow
def test_an_optuna_study_and_a_grid_optimise_the_k_fold_mean(tmp_path: Path) -> None:
    import optuna

    from runner.search.trial import RUN_DIR_ATTR, open_storage

    db, journal = tmp_path / "mlflow.db", tmp_path / "study.journal"
    common = ["trainer.cross_validation.folds=2", "trainer.max_steps=3", "trainer.progress_bar=off",
              "trainer.memory_estimate=false", f"tracking.uri=sqlite:///{db}"]
    proc = run_cli(["-m", "hparams_search=digits_optuna", f"hydra.sweeper.storage={journal}", "hydra.sweeper.n_trials=2",
                    "hydra/sweeper/pruner=median", *common], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("runner: 2-fold cross-validation (stratified folds, fold seed 0), val/acc ") == 2
    study = optuna.load_study(study_name="digits_optuna", storage=open_storage(str(journal)))
    found = runs(db)
    (sweep_parent,) = [rid for rid, r in found.items() if r["name"] == "digits_optuna"]
    for trial in study.trials:
        k_fold = (Path(trial.system_attrs[RUN_DIR_ATTR]) / "mlflow_run_id").read_text().strip()
        assert found[k_fold]["parent"] == sweep_parent  # study -> K-fold run -> folds
        objectives = [k["metrics"]["objective"][-1][1] for k in children(db, k_fold)]
        assert len(objectives) == 2
        assert trial.value == pytest.approx(statistics.fmean(objectives), abs=1e-12)
        assert trial.intermediate_values == pytest.approx({0: objectives[0], 1: trial.value})

    grid = run_cli(["-m", "optimizer.lr=0.01,0.001", *common], cwd=tmp_path)
    assert grid.returncode == 0, grid.stderr[-3000:]
    found = runs(db)
    (grid_parent,) = [rid for rid, r in found.items() if r["tags"].get("runner.sweeper") == "basic"]
    k_folds = [rid for rid, r in found.items() if r["parent"] == grid_parent]
    assert len(k_folds) == 2
    table = grid.stdout[grid.stdout.index("runner: 2 jobs in "):]
    for rid in k_folds:
        mean = statistics.fmean(k["metrics"]["objective"][-1][1] for k in children(db, rid))
        assert found[rid]["metrics"][f"cv/{METRIC}_mean"][0][1] == pytest.approx(mean)
        assert f"{mean:.4f}" in table  # the value the grid got is the K-fold mean


@pytest.mark.slow
def test_a_killed_k_fold_run_resumes_at_the_killed_fold_from_the_command_line(tmp_path: Path) -> None:
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "cv"
    args = ["trainer.cross_validation.folds=2", "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2", "trainer.log_every_n_steps=1",
            "trainer.progress_bar=off", "trainer.memory_estimate=false", f"tracking.uri=sqlite:///{db}",
            f"hydra.run.dir={run_dir}"]
    killed = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "kill_at.py"), "step", "7", *args],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fold 1's step 3: SIGKILL
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert list(read_record(run_dir)) == [0]
    fold_1 = (run_dir / "fold-1" / "mlflow_run_id").read_text().strip()
    resumed = run_cli([f"trainer.resume={run_dir}", "trainer.progress_bar=off", f"tracking.uri=sqlite:///{db}"],
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "folds 0 done already" in resumed.stdout + resumed.stderr
    assert (run_dir / "fold-1" / "mlflow_run_id").read_text().strip() == fold_1
    parent_id = (run_dir / "mlflow_run_id").read_text().strip()
    kids = children(db, parent_id)
    assert [k["status"] for k in kids] == ["FINISHED", "FINISHED"] and runs(db)[parent_id]["status"] == "FINISHED"
    assert [s for s, _ in kids[1]["metrics"]["train/loss"]] == [1, 2, 3, 4]  # each step once, across the kill
    record = read_record(run_dir)
    assert statistics.fmean(record[k]["objective"] for k in (0, 1)) == pytest.approx(
        runs(db)[parent_id]["metrics"][f"cv/{METRIC}_mean"][0][1])
    # fold 0's results on the K-fold run, logged before the kill, each fold once: the kill loses none
    assert runs(db)[parent_id]["metrics"][f"cv/{METRIC}"] == [(k, pytest.approx(record[k]["objective"])) for k in (0, 1)]


@pytest.mark.slow
def test_a_k_fold_run_killed_between_a_folds_record_and_its_logging_logs_it_on_resume(tmp_path: Path) -> None:
    """A SIGKILL right after fold 0 is recorded, before its cv/* reach the K-fold run's MLflow run: the resume
    skips fold 0 (recorded) and logs its results then, each fold's once, at step = fold."""
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "cv"
    args = ["trainer.cross_validation.folds=2", "trainer.max_steps=2", "trainer.progress_bar=off",
            "trainer.memory_estimate=false", f"tracking.uri=sqlite:///{db}", f"hydra.run.dir={run_dir}"]
    killed = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "kill_at.py"), "fold_recorded", "1",
                             *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    parent_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert list(read_record(run_dir)) == [0] and f"cv/{METRIC}" not in runs(db)[parent_id]["metrics"]
    resumed = run_cli([f"trainer.resume={run_dir}", "trainer.progress_bar=off", f"tracking.uri=sqlite:///{db}"],
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record, parent = read_record(run_dir), runs(db)[parent_id]
    assert parent["metrics"][f"cv/{METRIC}"] == [(k, pytest.approx(record[k]["objective"])) for k in (0, 1)]
    assert [k["metrics"]["cv/fold"] for k in children(db, parent_id)] == [[(0, 0.0)], [(0, 1.0)]]


def _fold_on_rank(rank: int, world: int, spec_yaml: str):
    from runner.engine.parallel import DistEnv

    spec = RunSpec.from_yaml(spec_yaml)
    Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
    return launch.run_in_process(spec, DistEnv(rank, world, rank))


def test_folds_on_two_ranks_equal_single_process_folds(tmp_path: Path, two_ranks) -> None:
    """Each fold's run on the session's 2 gloo ranks with half the batch (the launcher's own workers: the slow test
    below) trains as one process: each fold's objective and final value, and the mean."""
    from runner.search import cross_validation

    base = ["trainer.cross_validation.folds=2", "trainer.max_steps=4", "trainer.progress_bar=off",
            "trainer.memory_estimate=false", "trainer.device=cpu"]
    single = launch.run(compose_spec([*base, "dataset.batch_size=64"], tmp_path / "single"))
    spec = compose_spec([*base, "dataset.batch_size=32", "parallelism=ddp", "parallelism.nproc_per_node=2"], tmp_path / "ddp")
    (tmp_path / "ddp").mkdir()
    ddp = cross_validation.run_folds(spec, tmp_path / "ddp", run_one=lambda fold: two_ranks.run(_fold_on_rank, fold.to_yaml())[0])
    one, two = read_record(tmp_path / "single"), read_record(tmp_path / "ddp")
    for k in (0, 1):
        assert two[k]["objective"] == pytest.approx(one[k]["objective"], abs=1e-6)
        assert two[k]["final"] == pytest.approx(one[k]["final"], rel=1e-4)
    assert ddp.objective == pytest.approx(single.objective, abs=1e-6)


@pytest.mark.slow
def test_ddp_folds_equal_single_process_folds(tmp_path: Path) -> None:
    """Each fold launched as today's runs are: 2 gloo workers with half the batch train as one process."""
    base = ["trainer.cross_validation.folds=2", "trainer.max_steps=4", "trainer.progress_bar=off",
            "trainer.memory_estimate=false", "trainer.device=cpu"]
    single = launch.run(compose_spec([*base, "dataset.batch_size=64"], tmp_path / "single"))
    ddp = launch.run(compose_spec([*base, "dataset.batch_size=32", "parallelism=ddp", "parallelism.nproc_per_node=2"],
                                  tmp_path / "ddp"))
    one, two = read_record(tmp_path / "single"), read_record(tmp_path / "ddp")
    for k in (0, 1):
        assert two[k]["objective"] == pytest.approx(one[k]["objective"], abs=1e-6)
        assert two[k]["final"] == pytest.approx(one[k]["final"], rel=1e-4)
    assert ddp.objective == pytest.approx(single.objective, abs=1e-6)


# --- k-fold owns its rules: the finders once before the folds, extension, `latest`

def test_a_finder_runs_once_on_the_k_fold_run_and_every_fold_trains_with_its_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """tune=lr_find tune.apply=true: one sweep, before fold 0; both folds train with its lr (not one each)."""
    from runner.tune import lr_find

    sweeps = []
    find_lr = lr_find.find_lr
    monkeypatch.setattr(lr_find, "find_lr", lambda engine, tune: sweeps.append(engine.spec.run_dir) or find_lr(engine, tune))
    run_dir = tmp_path / "cv"
    result = launch.run(compose_spec([*TINY, "trainer.cross_validation.folds=2", "tune=lr_find", "tune.steps=20",
                                      "tune.apply=true"], run_dir))
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "suggested: optimizer.lr=" in line]
    lr = float(line.split("optimizer.lr=")[1].split()[0])
    assert sweeps == [str(run_dir)]  # once, on the k-fold run
    trained = [RunSpec.from_yaml((run_dir / f"fold-{k}" / "spec.yaml").read_text()) for k in (0, 1)]
    assert [s.optimizer.lr for s in trained] == [lr, lr] and all(s.tune.name is None for s in trained)
    parent = RunSpec.from_yaml((run_dir / "spec.yaml").read_text())
    assert parent.optimizer.lr == lr and parent.tune.name is None  # the k-fold run's record: what its folds trained
    record = read_record(run_dir)
    assert sorted(record) == [0, 1] and result.objective == statistics.fmean(record[k]["objective"] for k in (0, 1))


def test_a_finder_without_apply_on_a_k_fold_run_reports_and_trains_no_fold(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture) -> None:
    from runner import tune

    run_dir = tmp_path / "cv"
    result = launch.run(compose_spec([*TINY, "trainer.cross_validation.folds=2", "tune=lr_find", "tune.steps=20"], run_dir))
    assert result is tune.NOTHING_TRAINED
    assert capsys.readouterr().out.count("suggested: optimizer.lr=") == 1
    assert not list(run_dir.glob("fold-*")) and not (run_dir / RECORD).exists()


def test_extending_a_finished_k_fold_run_extends_every_fold_and_recomputes_the_mean(
        store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    run_dir, db = tmp_path / "cv", Path(store.removeprefix("sqlite:///"))
    launch.run(compose_spec([*TINY, "trainer.cross_validation.folds=2"], run_dir, tracking_uri=store))
    assert [read_record(run_dir)[k]["steps"] for k in (0, 1)] == [3, 3]
    steps: list[tuple[str, int]] = []
    train_step = Engine.train_step

    def counted(self, micro_batches):
        steps.append((Path(self.spec.run_dir).name, self.progress.step + 1))
        return train_step(self, micro_batches)

    monkeypatch.setattr(Engine, "train_step", counted)
    caplog.set_level("INFO")
    caplog.clear()  # the extending command's lines only (the first run's may be captured too)
    result = launch.run(compose_spec([f"trainer.resume={run_dir}", "trainer.max_steps=5"], tmp_path / "unused",
                                     tracking_uri=store))
    # each fold resumes its own step-3 checkpoint and trains on to step 5
    assert steps == [("fold-0", 4), ("fold-0", 5), ("fold-1", 4), ("fold-1", 5)]
    record = read_record(run_dir)
    assert [record[k]["steps"] for k in (0, 1)] == [5, 5]
    mean = statistics.fmean(record[k]["objective"] for k in (0, 1))
    assert result.objective == mean
    parent_id = (run_dir / "mlflow_run_id").read_text().strip()
    parent = runs(db)[parent_id]
    assert parent["status"] == "FINISHED" and parent["metrics"][f"cv/{METRIC}_mean"][-1][1] == pytest.approx(mean)
    assert [fold["status"] for fold in children(db, parent_id)] == ["FINISHED", "FINISHED"]
    assert RunSpec.from_yaml((run_dir / "spec.yaml").read_text()).trainer.max_steps == 5
    messages = caplog.text
    assert "holds no checkpoint yet" not in messages and "starts over" not in messages
    assert "extending folds 0, 1 from their checkpoints to trainer.max_steps=5" in messages
    # each fold's summary names its run; how to open the UI is said once, with the K-fold run's table
    assert messages.count("runner: trained") == 2 and messages.count(f"mlflow_ui --backend-store-uri {store}") == 1


def test_latest_is_the_k_fold_run_not_its_newest_fold(tmp_path: Path) -> None:
    from runner.cli.run_dir import latest_run

    older, k_fold = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    (older / "checkpoints").mkdir(parents=True)
    (older / "spec.yaml").write_text("x")
    (older / "checkpoints" / "step-1.pt").write_text("x")
    for path in (k_fold / "spec.yaml", k_fold / "fold-0" / "spec.yaml", k_fold / "fold-1" / "checkpoints" / "step-2.pt"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    (k_fold / "fold-1" / "spec.yaml").write_text("x")
    assert latest_run(tmp_path / "runs") == k_fold.absolute()


@pytest.mark.slow
def test_resume_latest_after_a_killed_k_fold_run_goes_on_at_the_killed_fold(tmp_path: Path) -> None:
    db, run_dir = tmp_path / "mlflow.db", tmp_path / "outputs" / "runs" / "cv"
    args = ["trainer.cross_validation.folds=2", "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2",
            "trainer.progress_bar=off", "trainer.memory_estimate=false", f"tracking.uri=sqlite:///{db}"]
    killed = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "kill_at.py"), "step", "7", *args,
                             f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL in fold 1's step 3
    assert list(read_record(run_dir)) == [0]
    resumed = run_cli(["trainer.resume=latest", "trainer.progress_bar=off", f"tracking.uri=sqlite:///{db}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"trainer.resume=latest: {run_dir}, the newest run" in resumed.stdout + resumed.stderr
    assert "folds 0 done already" in resumed.stdout + resumed.stderr
    record = read_record(run_dir)
    assert sorted(record) == [0, 1] and record[1]["steps"] == 4
    parent_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert runs(db)[parent_id]["status"] == "FINISHED"
    assert runs(db)[parent_id]["metrics"][f"cv/{METRIC}_mean"][-1][1] == pytest.approx(
        statistics.fmean(record[k]["objective"] for k in (0, 1)))


def test_resuming_a_k_fold_run_says_it_goes_on_at_its_fold_not_that_it_starts_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 26, 1.6: the resume of a k-fold run killed before its next fold's first checkpoint printed
    "... starts over from step 0" while it went on at that fold, fold 0 kept."""
    run_dir = tmp_path / "cv"
    overrides = [*TINY, "trainer.max_steps=1", "trainer.cross_validation.folds=2"]
    train_step, stop = Engine.train_step, [True]

    def killed_in_fold_1(self, micro_batches):
        if Path(self.spec.run_dir).name == "fold-1" and stop:  # fold 1's first step: it has no checkpoint yet
            stop.clear()
            raise KeyboardInterrupt
        return train_step(self, micro_batches)

    monkeypatch.setattr(Engine, "train_step", killed_in_fold_1)
    with pytest.raises(KeyboardInterrupt):
        launch.run(compose_spec(overrides, run_dir))
    assert list(read_record(run_dir)) == [0] and (run_dir / "fold-1" / "spec.yaml").is_file()
    caplog.clear()
    with caplog.at_level("INFO"):
        launch.run(compose_spec([f"trainer.resume={run_dir}"], tmp_path / "unused"))
    said = caplog.text
    assert f"continuing the k-fold run in {run_dir}" in said
    assert "starts over from step 0" not in said, said
    assert "folds 0 done already" in said and f"continuing fold 1 in {run_dir / 'fold-1'}" in said
    assert "fold 1 holds no checkpoint yet: it starts over from its step 0 (the k-fold run goes on at fold 1)" in said
    assert sorted(read_record(run_dir)) == [0, 1]
