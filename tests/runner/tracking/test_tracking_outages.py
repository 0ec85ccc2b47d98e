"""Tracking never makes training wait (runner/tracking/writer.py, journal.py): a store that is locked, a
server that is stopped or killed. Real parts only: a sqlite store locked by another connection, a real
`mlflow server` stopped with SIGSTOP or killed with SIGKILL. What arrives is read back from the store
and compared with a run logged to a plain sqlite store."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from mlflow.tracking import MlflowClient

from runner.specs.run import RunSpec
from runner.specs.tracking import TrackingSpec
from runner.tracking import journal
from runner.tracking.tracker import build_tracker
from tests.conftest import REPO
from tests.servers.mlflow import mlflow_server

# a digits run long enough to stop a server in, with a validation line every 50 steps to follow it by
RUN = ["trainer.max_steps=400", "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=50",
       "trainer.eval_every_epoch=false", "trainer.checkpoint_every_n_steps=100", "trainer.progress_bar=off"]
EVAL_LINE = re.compile(r"step (\d+): val/")
TIMING = "throughput/"  # measured, so never equal between two runs; their steps are


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}


def journal_histories(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    out: dict[str, list[tuple[int, float]]] = {}
    for step, _, values in journal.read(run_dir / journal.FILE, run_id):
        for key, value in values.items():
            out.setdefault(key, []).append((step, value))
    return {key: sorted(points) for key, points in out.items()}


def assert_same_run(got: dict, want: dict) -> None:
    """Every metric of `want`, each step once, equal values (measured ones: the same steps)."""
    assert sorted(got) == sorted(want)
    for key, points in got.items():
        steps = [s for s, _ in points]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice"
        if key.startswith(TIMING):
            assert steps == [s for s, _ in want[key]], key
        else:
            assert points == want[key], key


def spec_at(tmp_path: Path, uri: str) -> RunSpec:
    return RunSpec(run_dir=str(tmp_path / "run"), tracking=TrackingSpec(uri=uri, artifact_root=str(tmp_path / "artifacts")))


@contextlib.contextmanager
def locked(db: Path) -> Iterator[None]:
    """The sqlite file locked by another connection (a writer holding it): MLflow can neither read nor write it."""
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        con.execute("ROLLBACK")
        con.close()


# --- a sqlite store that cannot be written for a while --------------------------------------------------


def test_steps_logged_while_the_store_is_locked_never_wait_and_all_arrive_after(tmp_path: Path, store: str) -> None:
    spec = spec_at(tmp_path, store)
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.flush()  # the run's params and record stored: from here only this test's steps go to the store
    logged = {}
    with locked(tmp_path / "mlflow.db"):
        for step in range(1, 201):  # each call returns while the store can take nothing: no call waits for it
            logged[step] = 1.0 / step
            tracker.log_metrics({"train/loss": logged[step], "lr": 0.1}, step)
            if step % 50 == 0:
                tracker.flush(wait=False)  # a checkpoint: the journal written out, the store not waited for
        held_meanwhile = journal_histories(tmp_path / "run")
    assert [s for s, _ in held_meanwhile["train/loss"]] == list(range(1, 201))  # on disk while the store was locked
    tracker.finish("FINISHED")
    client = MlflowClient(store)
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "train/loss")) == sorted(logged.items())
    assert [m.step for m in client.get_metric_history(tracker.run_id, "lr")] == list(range(1, 201))


def test_a_local_store_locked_through_the_end_is_said_busy_not_unreachable(tmp_path: Path, store: str,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35, item 13: a local sqlite file held by another process (or slow on a loaded machine) was "unreachable",
    a word for a server; the file is busy, and the messages say so, while training and at the run's end."""
    monkeypatch.setenv("RUNNER_TRACKING_PATIENCE_S", "1")
    spec = spec_at(tmp_path, store)
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.flush()
    with caplog.at_level("WARNING"), locked(tmp_path / "mlflow.db"):
        for step in range(1, 11):
            tracker.log_metrics({"train/loss": 1.0 / step}, step)
        tracker.flush(wait=False)
        for _ in range(600):  # the store's busy timeout (5 s), then the outage is said
            if tracker.unreachable:
                break
            time.sleep(0.1)
        tracker.finish("FINISHED")
    said = [r.getMessage() for r in caplog.records if store in r.getMessage()]
    assert not any("unreachable" in m for m in said), said
    assert any(m.startswith(f"MLflow at {store}: busy since step 10 (") and "database is locked" in m for m in said), said
    assert sum(f"MLflow at {store} is still busy at the end of the run: 10 metric values (from step 1)" in m
               for m in said) == 1, said


# A user's chmod of a store in the middle of a run (its folder and file made read-only, as `chmod a-w` does): root
# writes through permission bits, so as root the run drops the capability that lets it (a user's process has none).
READ_ONLY_WORKER = textwrap.dedent("""
    import os, sys, time
    os.environ["RUNNER_TRACKING_PATIENCE_S"] = "1"
    from runner.specs.run import RunSpec
    from runner.specs.tracking import TrackingSpec
    from runner.tracking.tracker import build_tracker

    root = sys.argv[1]
    spec = RunSpec(run_dir=f"{root}/run", tracking=TrackingSpec(uri=f"sqlite:///{root}/store/mlflow.db",
                                                              artifact_root=f"{root}/artifacts"))
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.flush()
    print("started", tracker.run_id, flush=True)
    sys.stdin.readline()  # the test makes the store read-only now
    for step in range(1, 21):
        tracker.log_metrics({"loss": 1.0 / step}, step)
    tracker.flush(wait=False)
    for _ in range(600):
        if tracker.unreachable:
            break
        time.sleep(0.1)
    tracker.finish("FINISHED")
""")


def test_a_store_made_read_only_mid_run_is_said_read_only_in_plain_lines_and_the_run_ends(tmp_path: Path, store: str) -> None:
    """Issue 35, item 13: a store turned read-only was "unreachable" (or, through MLflow, hundreds of lines of
    SQLAlchemy's tracebacks). Nothing can be written to it: the run trains on and ends (tracking is what a user
    fixes, not the training), says once that the store is read-only and where every metric is kept."""
    (tmp_path / "store").mkdir()
    shutil.move(store.removeprefix("sqlite:///"), tmp_path / "store" / "mlflow.db")
    command = [sys.executable, "-c", READ_ONLY_WORKER, str(tmp_path)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root writes through permission bits, and setpriv is not here to drop that")
        command = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                   "--bounding-set=-dac_override,-dac_read_search", *command]
    worker = subprocess.Popen(command, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert worker.stdout.readline().startswith("started")
        (tmp_path / "store" / "mlflow.db").chmod(0o444)
        (tmp_path / "store").chmod(0o555)
        _, err = worker.communicate("go\n", timeout=120)
    finally:
        (tmp_path / "store").chmod(0o755)
    assert worker.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and not any("unreachable" in line for line in lines), err[-3000:]
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"MLflow at {uri}: read-only since step 20 ((sqlite3.OperationalError) attempt to "
                               "write a readonly database); retrying, training goes on"), lines
    assert lines[0].endswith("holds every metric; make it writable again, and what waits is written"), lines
    assert lines[1].startswith(f"MLflow at {uri} is still read-only at the end of the run: 20 metric values (from step "
                               "1)"), lines
    assert str(tmp_path / "run" / journal.FILE) in lines[1]


# A process that logs steps first..last through the tracker, writes "checkpoints" (flush without waiting, as
# the engine does) every 5 steps, and SIGKILLs itself at kill_at (-1: never): what the writer had queued is
# lost with it. It starts logging when told on stdin (the test locks the store first).
WORKER = textwrap.dedent("""
    import os, signal, sys
    from runner.specs.run import RunSpec
    from runner.specs.tracking import TrackingSpec
    from runner.tracking.tracker import build_tracker

    root, first, last, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if len(sys.argv) > 5:  # seconds finish waits for a store that stores nothing (30 by default)
        import runner.tracking.tracker
        runner.tracking.tracker._PATIENCE_S = float(sys.argv[5])
    spec = RunSpec(run_dir=f"{root}/run", tracking=TrackingSpec(uri=f"sqlite:///{root}/mlflow.db",
                                                              artifact_root=f"{root}/artifacts"))
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.flush()
    print("started", tracker.run_id, flush=True)
    sys.stdin.readline()  # the test locks the store now
    for step in range(first, last + 1):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step)
        if step % 5 == 4:
            tracker.flush(wait=False)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    tracker.finish("FINISHED")
""")


@pytest.mark.slow  # two processes importing MLflow (30+ s on a loaded machine); in CI: test_resume's kill at final_eval
def test_a_run_killed_while_its_store_was_locked_is_completed_from_its_journal_by_the_resume(
        tmp_path: Path, store: str) -> None:
    killed = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), "0", "19", "12"], env=env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = killed.stdout.readline().split()[1]
    with locked(tmp_path / "mlflow.db"):
        killed.stdin.write("go\n")
        killed.stdin.flush()
        _, err = killed.communicate(timeout=120)  # killed at step 12, its last "checkpoint" at step 9
    assert killed.returncode == -signal.SIGKILL, err
    client = MlflowClient(store)
    assert client.get_metric_history(run_id, "loss") == []  # the store got nothing of it
    resumed = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), "10", "19", "-1"], env=env(),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = resumed.communicate("go\n", timeout=120)  # the run directory's run, from the checkpoint of step 9
    assert resumed.returncode == 0, err
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert history == [(step, 1.0 / (step + 1)) for step in range(20)]  # each step once: 0-9 (and 10-12) from the journal
    assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow  # a process importing MLflow (15+ s on a loaded machine)
def test_a_run_that_ends_while_its_store_is_locked_exits_0_and_the_next_open_of_the_store_completes_it(
        tmp_path: Path, store: str, caplog: pytest.LogCaptureFixture) -> None:
    from runner.tracking.mlflow_store import end_orphaned_runs

    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), "0", "19", "-1", "2"], env=env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = worker.stdout.readline().split()[1]
    with locked(tmp_path / "mlflow.db"):
        _, err = worker.communicate("go\n", timeout=120)
    assert worker.returncode == 0, err
    assert "Traceback" not in err
    assert err.count("is still busy at the end of the run") == 1, err  # a local file: busy, not unreachable
    client = MlflowClient(store)
    assert client.get_run(run_id).info.status == "RUNNING" and client.get_metric_history(run_id, "loss") == []
    assert end_orphaned_runs(client) == [run_id]  # what any runner command on the store does when it opens it
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss")) == [
        (step, 1.0 / (step + 1)) for step in range(20)]
    assert "ended FINISHED while this store could not be reached: completed now; 20 metric values" in caplog.text


# a process killed in the middle of a sqlite transaction (the writer's thread, say), leaving a hot journal
KILLED_MID_TRANSACTION = textwrap.dedent("""
    import os, signal, sqlite3, sys
    con = sqlite3.connect(sys.argv[1], isolation_level=None)
    con.execute("PRAGMA cache_size=1")  # pages spill to the file before the commit: the journal is needed
    con.execute("BEGIN IMMEDIATE")
    con.execute("CREATE TABLE filler (x BLOB)")
    con.executemany("INSERT INTO filler VALUES (zeroblob(4096))", [()] * 200)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_store_left_with_a_hot_journal_by_a_killed_process_opens(tmp_path: Path, store: str) -> None:
    from runner.tracking.mlflow_store import check_tracking

    db = tmp_path / "mlflow.db"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_TRANSACTION, str(db)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL and db.with_name("mlflow.db-journal").exists()
    check_tracking(TrackingSpec(uri=store, artifact_root=str(tmp_path / "artifacts")))  # no "cannot be read"
    spec = spec_at(tmp_path, store)
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.log_metrics({"loss": 0.5}, 1)
    tracker.finish("FINISHED")
    assert [m.value for m in MlflowClient(store).get_metric_history(tracker.run_id, "loss")] == [0.5]
    with sqlite3.connect(db) as con:  # the killed transaction rolled back
        assert con.execute("SELECT count(*) FROM sqlite_master WHERE name = 'filler'").fetchone() == (0,)


# --- a real MLflow server, stopped and killed ---------------------------------------------------------


class Training:
    """`python -m runner` in the background, its output lines read as they come."""

    def __init__(self, args: list[str], cwd: Path, code: str | None = None):
        command = [sys.executable, "-m", "runner"] if code is None else [sys.executable, "-c", code]
        self.proc = subprocess.Popen([*command, *args], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def eval_steps(self, after: int = 0) -> list[int]:
        return [int(m.group(1)) for line in self.lines[after:] if (m := EVAL_LINE.search(line))]

    def until(self, condition, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not condition() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def end(self, timeout: float = 300) -> tuple[int, str]:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.proc.returncode, "".join(self.lines)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, migrated_mlflow_store: Path) -> dict:
    """RUN logged to a plain sqlite store: its metric histories."""
    root = tmp_path_factory.mktemp("reference")
    shutil.copy(migrated_mlflow_store, root / "mlflow.db")
    code, out = Training([*RUN, f"tracking.uri=sqlite:///{root}/mlflow.db", f"tracking.artifact_root={root}/artifacts",
                          f"hydra.run.dir={root}/run"], root).end()
    assert code == 0, out[-3000:]
    return histories(MlflowClient(f"sqlite:///{root}/mlflow.db"), (root / "run" / "mlflow_run_id").read_text().strip())


@pytest.mark.cluster  # the one mlflow server case in CI (about 30 s quiet: a server start and two runs)
def test_a_stopped_server_holds_up_no_step_and_gets_every_value_once_it_continues(
        tmp_path: Path, migrated_mlflow_store: Path, reference: dict) -> None:
    with mlflow_server(tmp_path / "server", migrated_mlflow_store) as (uri, server):
        run = Training([*RUN, f"tracking.uri={uri}", f"hydra.run.dir={tmp_path}/run"], tmp_path)
        run.until(lambda: run.eval_steps())  # training: the run exists on the server
        os.killpg(server.pid, signal.SIGSTOP)
        stopped_at = len(run.lines)
        run.until(lambda: len(run.eval_steps(stopped_at)) >= 3, timeout=120)
        trained_while_stopped = run.eval_steps(stopped_at)
        os.killpg(server.pid, signal.SIGCONT)
        code, out = run.end()
        assert code == 0, out[-3000:]
        print(f"validated at steps {trained_while_stopped} while the server was stopped")
        assert len(trained_while_stopped) >= 3  # training went on: 150 steps, 3 validations, 1 checkpoint or more
        assert "Traceback" not in out
        client = MlflowClient(uri)
        run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
        assert client.get_run(run_id).info.status == "FINISHED"
        assert_same_run(histories(client, run_id), reference)
    assert_same_run(journal_histories(tmp_path / "run"), reference)  # the run directory's copy, equally whole


# the run with a patience of 3 s at its end (30 s by default) for a store that stores nothing
PATIENT_3S = ("import runpy, sys; import runner.tracking.tracker as t; t._PATIENCE_S = 3.0; "
              "sys.argv = ['runner', *sys.argv[1:]]; runpy.run_module('runner', run_name='__main__')")


@pytest.mark.slow  # a server start (10-40 s on a loaded machine) and two runs
def test_a_server_killed_for_good_mid_run_fails_nothing_says_so_plainly_and_the_run_dir_holds_every_metric(
        tmp_path: Path, migrated_mlflow_store: Path, reference: dict) -> None:
    with mlflow_server(tmp_path / "server", migrated_mlflow_store) as (uri, server):
        run = Training([*RUN, f"tracking.uri={uri}", f"hydra.run.dir={tmp_path}/run"], tmp_path, code=PATIENT_3S)
        run.until(lambda: run.eval_steps())
        os.killpg(server.pid, signal.SIGKILL)
        code, out = run.end()
    print(out[-2000:])
    assert code == 0, out[-3000:]
    assert "Traceback" not in out and "Retrying" not in out
    about_mlflow = [line for line in out.splitlines() if uri in line and "unreachable" in line]
    ending = [line for line in about_mlflow if "still unreachable at the end of the run" in line]
    assert len(ending) == 1 and str(tmp_path / "run" / journal.FILE) in ending[0]
    assert len(about_mlflow) <= 2  # the outage said at most once while training, and its end once
    assert_same_run(journal_histories(tmp_path / "run"), reference)


# --- a server down past every retry, through the end of the run, and back later -------------------------

# A run's whole tracking while its server is down: everything after the start is logged with the server
# killed (metrics, the summary, tags, an artifact, a model saved in the run directory), and the run ends.
# Retries and waits are seconds: from the outage on, MLflow's HTTP client tries once; the tracker waits 1 s.
OUTAGE_WORKER = textwrap.dedent("""
    import logging, os, sys
    from pathlib import Path
    import mlflow.pytorch, torch
    logging.getLogger().setLevel(logging.WARNING)  # as runner's CLI has it (an import above left it at ERROR)
    from runner.specs.run import RunSpec
    from runner.specs.tracking import TrackingSpec
    from runner.tracking.tracker import build_tracker

    run_dir, uri = Path(sys.argv[1]), sys.argv[2]
    spec = RunSpec(run_dir=str(run_dir), overrides=("optimizer.lr=0.1",), tracking=TrackingSpec(uri=uri))
    tracker = build_tracker(spec)
    tracker.start(spec)
    while not tracker.flush():  # the start's calls stored (the run record takes seconds), whatever the wait
        pass
    print("started", tracker.run_id, flush=True)
    sys.stdin.readline()  # the test kills the server now
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")  # read at each request
    for step in range(1, 41):
        tracker.log_metrics({"train/loss": 1.0 / step}, step)
        if step % 20 == 0:
            tracker.log_metrics({"val/acc": step / 100}, step)
            tracker.flush(wait=False)
    tracker.log_summary(0.4, {"val/acc": 0.4}, 40)
    tracker.set_tags({"world_size": "1", "runner.outcome": "trained"})
    (run_dir / "curves.png").write_bytes(b"a plot")
    tracker.log_artifact(run_dir / "curves.png")
    torch.manual_seed(0)
    mlflow.pytorch.save_model(torch.nn.Linear(3, 2), str(run_dir / "mlflow_model"), serialization_format="pickle")
    tracker.log_saved_model(run_dir / "mlflow_model", "model", 40, {"runner.step": "40"}, "last@step 40")
    tracker.finish("FINISHED")
""")
SHORT_WAIT = {"RUNNER_TRACKING_PATIENCE_S": "1"}


@pytest.mark.slow  # two server starts and a process importing torch and MLflow: 60-190 s on this loaded machine
@pytest.mark.cluster
def test_a_run_that_ends_while_its_server_is_down_exits_0_and_arrives_whole_when_the_store_is_next_opened(
        tmp_path: Path, migrated_mlflow_store: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from runner.tracking.mlflow_store import end_orphaned_runs
    from tests.servers.mlflow import restarted, stop

    run_dir = tmp_path / "run"
    with mlflow_server(tmp_path / "server", migrated_mlflow_store) as (uri, server):
        worker = subprocess.Popen([sys.executable, "-c", OUTAGE_WORKER, str(run_dir), uri], env={**env(), **SHORT_WAIT},
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = next(line for line in worker.stdout if line.startswith("started") or not line)  # MLflow prints too
        run_id = started.split()[1]
        client = MlflowClient(uri)
        params = client.get_run(run_id).data.params  # stored before the outage (flush)
        stop(server)
        _, err = worker.communicate("go\n", timeout=180)
    assert worker.returncode == 0, err
    assert "Traceback" not in err
    ending = [line for line in err.splitlines() if "still unreachable at the end of the run" in line]
    assert len(ending) == 1, err[-3000:]
    ending = ending[0]
    assert "44 metric values (from step 1)" in ending and "the MLflow model 'model'" in ending and str(run_dir / journal.FILE) in ending
    assert (run_dir / "mlflow_model" / "MLmodel").exists()  # the model kept in the run directory
    port = int(uri.rsplit(":", 1)[1])
    with restarted(tmp_path / "server", port) as (uri, _):
        client = MlflowClient(uri)
        assert client.get_run(run_id).info.status == "RUNNING"  # as the process left it
        assert end_orphaned_runs(client) == [run_id]  # what any runner command on the store does when it opens it
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert run.data.params == params and "optimizer.lr" in params
        assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == [
            (step, 1.0 / step) for step in range(1, 41)]
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/acc")] == [(20, 0.2), (40, 0.4)]
        assert run.data.metrics["objective"] == 0.4 and run.data.metrics["best_val_acc"] == 0.4
        assert run.data.tags["world_size"] == "1" and run.data.tags["runner.outcome"] == "trained"
        assert "git_commit" in run.data.tags and "version.torch" in run.data.tags  # the run record
        assert {a.path for a in client.list_artifacts(run_id)} >= {"curves.png", "spec.yaml", "record"}
        (output,) = run.outputs.model_outputs
        assert output.step == 40
        model = client.get_logged_model(output.model_id)
        assert model.source_run_id == run_id and str(model.status).endswith("READY")
        assert run.data.tags["runner.logged_model"] == f"models:/{model.model_id} (last@step 40)"
        monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # where models:/ is looked up
        import mlflow.pytorch
        import torch

        torch.manual_seed(0)
        want = torch.nn.Linear(3, 2).state_dict()
        got = mlflow.pytorch.load_model(f"models:/{model.model_id}").state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert end_orphaned_runs(client) == []  # done once: nothing is sent twice
        assert len(client.get_metric_history(run_id, "train/loss")) == 40
    assert "ended FINISHED while this store could not be reached: completed now; 44 metric values and" in caplog.text


@pytest.fixture(scope="module")
def reference_with_model(tmp_path_factory: pytest.TempPathFactory, migrated_mlflow_store: Path) -> tuple:
    """RUN with its last model logged, to a plain sqlite store: (metric histories, params, tag names, the model's
    weights)."""
    import mlflow.pytorch

    root = tmp_path_factory.mktemp("reference_with_model")
    shutil.copy(migrated_mlflow_store, root / "mlflow.db")
    uri = f"sqlite:///{root}/mlflow.db"
    code, out = Training([*RUN, "tracking.log_model=last", f"tracking.uri={uri}", f"tracking.artifact_root={root}/artifacts",
                          f"hydra.run.dir={root}/run"], root).end()
    assert code == 0, out[-3000:]
    client = MlflowClient(uri)
    run = client.get_run((root / "run" / "mlflow_run_id").read_text().strip())
    (output,) = run.outputs.model_outputs
    with _tracking_uri(uri):
        weights = mlflow.pytorch.load_model(f"models:/{output.model_id}").state_dict()
    return histories(client, run.info.run_id), run.data.params, set(run.data.tags), weights


@contextlib.contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """models:/ URIs looked up in `uri` (pickled models loaded)."""
    import mlflow

    before = os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION")
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "true"
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)
        if before is None:
            del os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"]
        else:
            os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = before


LOCAL = ("run_dir", "tracking.")  # params that name where the run lives and logs: the two runs differ there


@pytest.mark.slow  # two server starts and three runs: minutes on a loaded machine
@pytest.mark.cluster
def test_a_trained_run_whose_server_dies_for_good_mid_run_finishes_and_the_resume_sends_it_whole_once_it_is_back(
        tmp_path: Path, migrated_mlflow_store: Path, reference_with_model: tuple) -> None:
    import mlflow.pytorch
    import torch

    from tests.servers.mlflow import restarted, stop

    want_metrics, want_params, want_tags, want_weights = reference_with_model
    run_dir = tmp_path / "run"
    args = [*RUN, "tracking.log_model=last", f"hydra.run.dir={run_dir}"]
    with mlflow_server(tmp_path / "server", migrated_mlflow_store) as (uri, server):
        run = Training([*args, f"tracking.uri={uri}"], tmp_path, code=PATIENT_3S)
        run.until(lambda: run.eval_steps())  # training: the run exists on the server
        stop(server)  # down for good: past MLflow's retries and the tracker's wait, until after the run ended
        code, out = run.end()
    assert code == 0, out[-3000:]
    assert "Traceback" not in out
    ending = [line for line in out.splitlines() if "still unreachable at the end of the run" in line]
    assert len(ending) == 1 and "the MLflow model 'model'" in ending[0] and str(run_dir / journal.FILE) in ending[0]
    assert f"MLflow model 'model' kept in {run_dir / 'mlflow_model'}" in out
    assert "runner: trained 400 optimizer steps" in out
    port = int(uri.rsplit(":", 1)[1])
    with restarted(tmp_path / "server", port) as (uri, _):
        resumed = Training([*args, f"tracking.uri={uri}", f"trainer.resume={run_dir}"], tmp_path)
        code, out = resumed.end()
        assert code == 0, out[-3000:]
        assert "completed now" in out
        client = MlflowClient(uri)
        run_id = (run_dir / "mlflow_run_id").read_text().strip()
        got = client.get_run(run_id)
        assert got.info.status == "FINISHED"
        assert_same_run(histories(client, run_id), want_metrics)  # every train/loss and val point, the summary
        assert {k: v for k, v in got.data.params.items() if not k.startswith(LOCAL)} == {
            k: v for k, v in want_params.items() if not k.startswith(LOCAL)}
        assert set(got.data.tags) >= want_tags - {"mlflow.source.name", "mlflow.source.type", "mlflow.user"}
        assert {a.path for a in client.list_artifacts(run_id)} >= {"curves.png", "spec.yaml", "record"}
        (output,) = got.outputs.model_outputs
        assert output.step == 400 and str(client.get_logged_model(output.model_id).status).endswith("READY")
        assert got.data.tags["runner.logged_model"].startswith(f"models:/{output.model_id} (")
        with _tracking_uri(uri):
            weights = mlflow.pytorch.load_model(f"models:/{output.model_id}").state_dict()
        assert weights.keys() == want_weights.keys()
        assert all(torch.equal(weights[k], want_weights[k]) for k in want_weights)  # the same model as uninterrupted
