"""Resume continues the run it names, from its own spec; faults (real SIGKILLs) lose nothing."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runner.cli import launch
from runner.engine import checkpoint

from runner.engine import resume_source
from runner.specs import components
from runner.engine.engine import Engine
from runner.specs.run import SpecError
from tests.conftest import REPO, compose_spec, run_cli

SAVED = ["trainer.max_epochs=3", "scheduler=cosine", "optimizer.lr=0.01", "trainer.max_steps=4",
         "trainer.progress_bar=off", "trainer.eval_every_epoch=false"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    Engine(compose_spec(SAVED, run_dir)).fit()
    return run_dir


def plan(overrides: list[str], run_dir: Path):
    return resume_source.plan(compose_spec(overrides, run_dir))


def test_a_resume_continues_the_runs_own_spec_not_todays_defaults(saved_run: Path, tmp_path: Path) -> None:
    planned = plan([f"trainer.resume={saved_run}"], tmp_path / "new")
    saved = components.resolved_spec(compose_spec(SAVED, saved_run))  # as the run saved it: defaults filled in
    assert planned.trainer.max_epochs == 3 and planned.scheduler.target == "runner.engine.schedule.cosine" and planned.optimizer.lr == 0.01
    assert planned.run_dir == str(saved_run)  # a run directory goes on in place
    assert planned.replace(trainer=saved.trainer, tracking=saved.tracking) == saved.replace(run_dir=str(saved_run))


def test_a_checkpoint_file_alone_is_enough_and_starts_a_new_run_directory(saved_run: Path, tmp_path: Path) -> None:
    ckpt = next((saved_run / "checkpoints").glob("step-*.pt"))
    (saved_run / "spec.yaml").unlink(missing_ok=True)  # the spec comes from inside the checkpoint
    planned = plan([f"trainer.resume={ckpt}", "trainer.max_steps=6"], tmp_path / "new")
    assert planned.run_dir == str(tmp_path / "new") and planned.trainer.max_steps == 6
    assert planned.scheduler.target == "runner.engine.schedule.cosine" and planned.trainer.resume == str(ckpt)


@pytest.mark.parametrize("override, key, saved, new", [
    ("optimizer.lr=0.5", "optimizer.lr", "0.01", "0.5"),
    ("optimizer=sgd", "optimizer._target_", "'torch.optim.Adam'", "'torch.optim.SGD'"),
    ("seed=3", "seed", "0", "3"),
    ("precision=bf16", "precision.name", "'fp32'", "'bf16'"),
    ("model.hidden=[8]", "model.hidden", "[256, 128]", "[8]"),
    ("trainer.clip_grad_norm=1.0", "trainer.clip_grad_norm", "None", "1.0"),
    ("scheduler=step", "scheduler._target_", "'runner.engine.schedule.cosine'", "'torch.optim.lr_scheduler.StepLR'"),
])
def test_an_override_that_changes_what_is_trained_stops_the_resume(saved_run: Path, tmp_path: Path, override: str,
                                                                   key: str, saved: str, new: str) -> None:
    with pytest.raises(SpecError) as error:
        plan([f"trainer.resume={saved_run}", override], tmp_path / "new")
    text = str(error.value)
    assert text.startswith(f"{key}: the resumed run was trained with {saved}, this resume sets {new}") and "\n" not in text


def test_how_long_where_and_where_it_logs_may_change_but_not_the_global_batch(saved_run: Path, tmp_path: Path) -> None:
    planned = plan([f"trainer.resume={saved_run}", "trainer.max_steps=9", "trainer.device=cpu", "dataset.num_workers=1",
                    "parallelism=ddp", "parallelism.nproc_per_node=2", "dataset.batch_size=32"], tmp_path / "new")
    assert (planned.trainer.max_steps, planned.dataset.num_workers, planned.parallelism.name) == (9, 1, "ddp")
    with pytest.raises(SpecError, match="global batch of 64 .* this resume gives 128"):
        plan([f"trainer.resume={saved_run}", "parallelism=ddp", "parallelism.nproc_per_node=2"], tmp_path / "new")


def test_a_wrong_resume_override_is_one_line_on_the_command_line(saved_run: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    # the CLI's entry in this process (tests/runner/test_bad_input.py: one line and exit 2 from real processes)
    from tests.runner.test_bad_input import RUN, run_in_process

    code, _, stderr = run_in_process([f"trainer.resume={saved_run}", "optimizer.lr=0.5", "tracking=none"], tmp_path, RUN,
                                     monkeypatch, capsys)
    assert code == 2 and stderr.strip().splitlines() == [
        stderr.strip()] and stderr.startswith("error: optimizer.lr: the resumed run was trained with 0.01")


# --- the CLI end to end: MLflow records -----------------------------------------------------------------

RUN = ["optimizer=adamw", "scheduler=warmup_cosine", "scheduler.warmup=5", "model.dropout=0.2", "+accum=2",
       "trainer.max_steps=40", "trainer.checkpoint_every_n_steps=10", "trainer.keep_checkpoints=10",
       "trainer.eval_every_n_steps=15", "trainer.log_every_n_steps=5", "trainer.progress_bar=off"]


def cli(args: list[str], cwd: Path, db: Path, kill: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    args = [*args, f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={cwd / 'artifacts'}"]
    if kill is None:
        return run_cli(args, cwd)
    cmd = [sys.executable, str(REPO / "tests" / "runner" / "kill_at.py"), kill[0], str(kill[1]), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def cli_in_process(args: list[str], cwd: Path, db: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """cli() through the CLI's entry in this process, sys.argv set (tests/runner/test_bad_input.py's
    run_in_process): (exit code, stdout, stderr) without an interpreter start (seconds). For what does not
    concern the process itself; kills and signals stay real processes."""
    from tests.runner.test_bad_input import RUN, run_in_process

    args = [*args, f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={cwd / 'artifacts'}"]
    return run_in_process(args, cwd, RUN, monkeypatch, capsys)


def mlflow_record(db: Path) -> dict:
    """Every run's status and its full metric history: {run name: (status, {metric: [(step, value)]})}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    record = {}
    for run in client.search_runs([e.experiment_id for e in client.search_experiments()]):
        history = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                   for key in run.data.metrics}
        record[run.info.run_id] = (run.info.status, history, run.data.tags)
    return record


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def migrated(db: Path, template: Path) -> Path:
    """db, a copy of an empty store MLflow has migrated (tests/conftest.py): no test here is about a first
    open of a new store (test_shared_store is), and each migration costs seconds."""
    shutil.copy(template, db)
    return db


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, migrated_mlflow_store: Path) -> tuple[dict, dict]:
    cwd = tmp_path_factory.mktemp("uninterrupted")
    db = migrated(cwd / "mlflow.db", migrated_mlflow_store)
    # as the CLI's launch runs it, in this process (an interpreter start saved, CI budget): the killed runs and
    # the resumes below are real processes (the resume of a run killed before its first checkpoint excepted),
    # and each must end bitwise equal to it
    launch.run(compose_spec(RUN, cwd / "run", f"sqlite:///{db}"))
    [(status, history, _)] = mlflow_record(cwd / "mlflow.db").values()
    assert status == "FINISHED"
    return weights(cwd / "run"), history


KILLS = [("step", 25), ("save", 2), ("final_eval", 1), ("finish_training", 1), ("after_final_checkpoint", 1),
         ("async_save", 2)]


@pytest.mark.parametrize("point, nth", [pytest.param(*k, marks=[] if k[0] in ("final_eval", "async_save") else pytest.mark.slow)
                                        for k in KILLS], ids=[k[0] for k in KILLS])
def test_a_killed_run_resumed_in_place_ends_as_if_never_stopped(tmp_path: Path, migrated_mlflow_store: Path,
                                                                 uninterrupted: tuple, point: str,
                                                                 nth: int) -> None:
    """async_save: killed while trainer.async_checkpoint's thread writes the shards of a checkpoint after the first
    one: the first stays the newest (the torn one has no manifest) and the resume from it ends bitwise equal."""
    want_weights, want_history = uninterrupted
    db = migrated(tmp_path / "mlflow.db", migrated_mlflow_store)
    saving = ["trainer.async_checkpoint=true"] if point == "async_save" else []
    killed = cli([*RUN, *saving, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, db, kill=(point, nth))
    assert killed.returncode == -9, killed.stderr
    assert not list((tmp_path / "run" / "checkpoints").glob(".*tmp*")) or point in ("save", "async_save")
    if point == "async_save":  # the checkpoint being written was never committed: the previous one is the newest
        newest = checkpoint.resolve(tmp_path / "run")
        assert list((tmp_path / "run" / "checkpoints").glob(".*tmp*")), "the kill was not during a save"
        assert checkpoint.read(tmp_path / "run")[0] == newest
    resumed = cli([f"trainer.resume={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'resume'}"], tmp_path, db)
    assert resumed.returncode == 0, resumed.stderr
    [(status, history, _)] = mlflow_record(db).values()  # one MLflow run: the same one, finished
    assert status == "FINISHED"
    timing = {"throughput/samples_per_s", "throughput/tflops"}
    assert {k: v for k, v in history.items() if k not in timing} == {k: v for k, v in want_history.items() if k not in timing}
    assert [s for s, _ in history["throughput/samples_per_s"]] == [s for s, _ in want_history["throughput/samples_per_s"]]
    got = weights(tmp_path / "run")
    assert all(torch.equal(got[k], want_weights[k]) for k in want_weights)
    assert not list((tmp_path / "run" / "checkpoints").glob(".*tmp*"))  # a save's leftovers are cleaned up


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path: Path, migrated_mlflow_store: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    db = migrated(tmp_path / "mlflow.db", migrated_mlflow_store)
    # both in this process (process starts saved): the run as the CLI's launch runs it, the resume through
    # the CLI's entry; a resume in a real process is test_a_killed_run_resumed_in_place_ends_as_if_never_stopped's
    launch.run(compose_spec(["trainer.max_steps=6", "trainer.progress_bar=off"], tmp_path / "run", f"sqlite:///{db}"))
    before = mlflow_record(db)
    code, out, err = cli_in_process([f"trainer.resume={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'again'}"],
                                    tmp_path, db, monkeypatch, capsys)
    assert code == 0 and "nothing left to do" in err + out
    after = mlflow_record(db)
    assert {k: v[:2] for k, v in after.items()} == {k: v[:2] for k, v in before.items()}


def test_another_runs_checkpoint_starts_new_runs_tagged_with_their_source(tmp_path: Path, migrated_mlflow_store: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture) -> None:
    db = migrated(tmp_path / "mlflow.db", migrated_mlflow_store)
    # both in this process (process starts saved): the source run as the CLI's launch runs it, the multirun
    # resuming from its checkpoint through the CLI's entry (a grid's jobs share a process as they do here)
    launch.run(compose_spec(["trainer.max_steps=6", "trainer.progress_bar=off"], tmp_path / "source", f"sqlite:///{db}"))
    [(source_id, source)] = mlflow_record(db).items()
    ckpt = tmp_path / "source" / "checkpoints" / "last.pt"
    code, _, err = cli_in_process(["-m", f"trainer.resume={ckpt}", "trainer.max_steps=8,10"], tmp_path, db, monkeypatch,
                                  capsys)
    assert code == 0, err[-3000:]
    record = mlflow_record(db)
    assert record[source_id][:2] == source[:2]  # the source run is untouched
    children = [r for rid, r in record.items() if r[2].get("runner.resumed_from_run") == source_id]
    assert sorted(max(s for s, _ in r[1]["train/loss"]) for r in children) == [8, 10]
    assert all(r[0] == "FINISHED" and min(s for s, _ in r[1]["train/loss"]) > 6 for r in children)


# --- records: a kill before the first checkpoint, SIGTERM/SIGHUP, run directories in use --------------

TIMING = {"throughput/samples_per_s", "throughput/tflops"}


def assert_as_uninterrupted(tmp_path: Path, db: Path, uninterrupted: tuple) -> None:
    """One MLflow run, FINISHED, with the uninterrupted run's history (each step once) and weights."""
    want_weights, want_history = uninterrupted
    [(status, history, _)] = mlflow_record(db).values()
    assert status == "FINISHED"
    assert {k: v for k, v in history.items() if k not in TIMING} == {k: v for k, v in want_history.items() if k not in TIMING}
    assert [s for s, _ in history["throughput/samples_per_s"]] == [s for s, _ in want_history["throughput/samples_per_s"]]
    got = weights(tmp_path / "run")
    assert all(torch.equal(got[k], want_weights[k]) for k in want_weights)


def test_a_run_killed_before_its_first_checkpoint_starts_over_in_place(tmp_path: Path, migrated_mlflow_store: Path,
                                                                       uninterrupted: tuple, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture) -> None:
    db = migrated(tmp_path / "mlflow.db", migrated_mlflow_store)
    # no checkpoint before the end (checkpoints change neither weights nor metrics): killed at step 35, the
    # run has only its spec.yaml and an MLflow run holding the steps sent before the kill
    killed = cli([*RUN, "trainer.checkpoint_every_n_steps=0", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, db,
                 kill=("step", 35))
    # (its checkpoints/ holds only the best weights so far, for trainer.test_on=best: not a checkpoint to resume)
    assert killed.returncode == -9 and not checkpoint.has_checkpoint(tmp_path / "run")
    [(status, _, _)] = mlflow_record(db).values()
    # its tracking process ends it KILLED once it sees the training process gone (runner/tracking/store_process.py),
    # which may come after this read; never FINISHED or FAILED
    assert status in ("RUNNING", "KILLED")
    # the kill is a real process; the resume goes through the CLI's entry in this process (an interpreter start
    # saved, CI budget): a resume in a real process is test_a_killed_run_resumed_in_place_ends_as_if_never_stopped's
    code, out, err = cli_in_process([f"trainer.resume={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'resume'}"],
                                    tmp_path, db, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    said = err + out
    assert f"continuing the run in {tmp_path / 'run'}\n" in said  # was "continuing the run in from"
    assert f"{tmp_path / 'run'} holds no checkpoint yet: the run starts over from step 0" in said
    assert_as_uninterrupted(tmp_path, db, uninterrupted)


@pytest.mark.slow  # CI budget; the same mechanism: test_shared_store's SIGKILL case
# runner/tracking/mlflow_store.py's end_orphaned_runs: the first open of a store ends runs whose process is gone
def test_a_killed_run_nobody_resumes_ends_killed_at_the_next_run_on_the_store(tmp_path: Path,
                                                                             migrated_mlflow_store: Path) -> None:
    db = migrated(tmp_path / "mlflow.db", migrated_mlflow_store)
    killed = cli(["trainer.max_steps=5", "trainer.progress_bar=off", f"hydra.run.dir={tmp_path / 'killed'}"], tmp_path, db,
                 kill=("step", 2))
    assert killed.returncode == -9
    [(killed_id, (status, _, tags))] = mlflow_record(db).items()
    assert status in ("RUNNING", "KILLED") and tags["runner.pid"].isdigit() and tags["runner.host"]
    assert cli(["trainer.max_steps=1", "trainer.progress_bar=off", f"hydra.run.dir={tmp_path / 'next'}"],
               tmp_path, db).returncode == 0
    assert mlflow_record(db)[killed_id][0] == "KILLED"


@pytest.mark.parametrize("signame, code, requeue", [("TERM", 143, True), pytest.param("HUP", 129, False, marks=pytest.mark.slow)])
def test_sigterm_and_sighup_stop_at_a_step_with_its_checkpoint_and_the_resume_ends_as_if_never_stopped(
        tmp_path: Path, migrated_mlflow_store: Path, uninterrupted: tuple, signame: str, code: int, requeue: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    db = migrated(tmp_path / "mlflow.db", migrated_mlflow_store)
    # the signal comes inside step 25 (not a checkpoint step): the run finishes that step and stops
    stopped = cli([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, db, kill=(f"step:{signame}", 25))
    assert stopped.returncode == code, stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1] == f"runner: stopped by SIG{signame} at step 25; the run was marked KILLED"
    [(status, history, _)] = mlflow_record(db).values()
    assert status == "KILLED" and max(s for s, _ in history["train/loss"]) == 25
    assert checkpoint.load(tmp_path / "run")["progress"]["step"] == 25
    newest = tmp_path / "run" / "checkpoints" / "step-00000025.pt"
    assert newest.exists()
    # a corrupt newest checkpoint: the resume falls back to step 20, says so once, and still ends the same
    shard = newest / "__0_0.distcp"  # the checkpoint is a folder of shards (one rank: one shard file)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(data)
    if requeue:  # SLURM requeues a preempted job: the same command again, in its own run directory
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        resumed = cli([*RUN, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, db)
    else:
        resumed = cli([f"trainer.resume={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'resume'}"], tmp_path, db)
    assert resumed.returncode == 0, resumed.stderr
    assert (resumed.stderr + resumed.stdout).count(f"skipping checkpoint {newest}") == 1
    assert_as_uninterrupted(tmp_path, db, uninterrupted)


def test_a_run_directory_is_held_by_one_process_and_a_new_run_never_reattaches_to_an_old_one(
        tmp_path: Path, migrated_mlflow_store: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A resume while the run trains is refused in one line naming its process; the run trains on alone
    (each step logged once) until SIGTERM stops it KILLED with the checkpoint of the step it reached. A new
    run into that directory is then refused too (it would reattach to the old MLflow run), changing nothing.
    The run is a real process; the two refused commands go through the CLI's entry in this process."""
    import signal
    import socket
    import sqlite3

    db = migrated(tmp_path / "mlflow.db", migrated_mlflow_store)
    run_dir = tmp_path / "run"
    store = [f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={tmp_path / 'artifacts'}"]
    first = subprocess.Popen([sys.executable, "-m", "runner", "trainer.max_steps=1000000", "trainer.progress_bar=off",
                              "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=5",
                              f"hydra.run.dir={run_dir}", *store], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = run_dir / ".runner.lock"
        deadline = time.time() + 240
        while first.poll() is None and time.time() < deadline and not (
                lock.exists() and lock.read_text().startswith(f"pid {first.pid}\n")):
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1]
        code, _, err = cli_in_process([f"trainer.resume={run_dir}", f"hydra.run.dir={tmp_path / 'second'}"], tmp_path, db,
                                      monkeypatch, capsys)
        assert code == 2
        assert err.strip().splitlines() == [
            f"error: trainer.resume: the run directory {run_dir} is in use by process {first.pid} on "
            f"{socket.gethostname()}; wait for that run to end or stop it (it stops at its next step with SIGTERM)"]
        assert not (tmp_path / "second").exists()
        while first.poll() is None and time.time() < deadline and not (run_dir / "checkpoints" / "last.pt").exists():
            time.sleep(0.05)  # training: SIGTERM then stops it at a step boundary
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1].startswith("runner: stopped by SIGTERM at step ")
    [(status, history, _)] = mlflow_record(db).values()
    last = max(s for s, _ in history["train/loss"])
    assert status == "KILLED" and checkpoint.load(run_dir)["progress"]["step"] == last
    with sqlite3.connect(db) as con:
        assert con.execute("select count(*) from metrics group by key, step having count(*) > 1").fetchall() == []
    assert lock.read_text() == ""  # released: a later resume may take it

    before, files = mlflow_record(db), {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    code, _, err = cli_in_process(["optimizer.lr=0.01", "seed=5", f"hydra.run.dir={run_dir}"], tmp_path, db, monkeypatch,
                                  capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: hydra.run.dir: {run_dir} already holds a run; a new run needs its own directory (leave hydra.run.dir "
        f"unset or name a new one), and trainer.resume={run_dir} continues that run"]
    assert mlflow_record(db) == before
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files


def test_a_lock_whose_process_is_gone_is_not_in_the_way(tmp_path: Path) -> None:
    from runner.cli.run_lock import owned

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from runner.cli.run_lock import owned\nwith owned(Path(sys.argv[1]), 'trainer.resume'):\n"
                               "    print('held', flush=True); time.sleep(600)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SpecError, match=f"^trainer.resume: the run directory {tmp_path} is in use by process "
                                            f"{holder.pid} on "):
            with owned(tmp_path, "trainer.resume"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with owned(tmp_path, "trainer.resume"):  # SIGKILLed: its lock went with it
        assert (tmp_path / ".runner.lock").read_text().startswith(f"pid {os.getpid()}\n")
