"""runner/tracking/tracker.py and runner/tracking/mlflow_store.py: MLflow runs that survive concurrency, kills, bad input."""
from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.tracking.mlflow_store import EXPERIMENT_KIND_TAG, MODEL_TRAINING, check_tracking, store_lock
from runner.specs.run import RunSpec, SpecError
from runner.specs.tracking import TrackingSpec
from runner.tracking.tracker import (MlflowTracker, NullTracker, Tracker, best_key, build_tracker, end_left_running,
                             params_of, run_name_from)
from tests.conftest import REPO, run_cli

# A process that logs one run through the tracker, as rank 0 of a real run would.
WORKER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from runner.specs.run import RunSpec
    from runner.specs.tracking import TrackingSpec
    from runner.tracking.tracker import build_tracker

    root, name, first, last, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    resume = sys.argv[6] if len(sys.argv) > 6 else None
    spec = RunSpec(run_dir=f"{root}/{name}", tracking=TrackingSpec(uri=f"sqlite:///{root}/mlflow.db",
                                                                 artifact_root=f"{root}/artifacts"))
    tracker = build_tracker(spec)
    tracker.start(spec, resume)
    print("run", tracker.run_id, flush=True)
    for step in range(first, last + 1):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "lr": 0.1}, step)
        if step == kill_after:
            tracker.flush()  # what the engine does right before it writes a checkpoint
        elif kill_after >= 0 and step == kill_after + 3:
            os.kill(os.getpid(), signal.SIGKILL)  # steps after the checkpoint were logged, not flushed
    tracker.finish("FINISHED")
""")


def worker(root: Path, name: str, first: int = 0, last: int = 4, kill_after: int = -1,
           resume: str | None = None) -> subprocess.Popen:
    args = [sys.executable, "-c", WORKER, str(root), name, str(first), str(last), str(kill_after)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(args + ([resume] if resume else []), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# the `store` fixture (a copy of a store MLflow migrated once per session) is in tests/conftest.py


def spec_at(tmp_path: Path, run: str = "run", **tracking) -> RunSpec:
    tracking = {"uri": f"sqlite:///{tmp_path}/mlflow.db", "artifact_root": str(tmp_path / "artifacts"), **tracking}
    return RunSpec(run_dir=str(tmp_path / run), tracking=TrackingSpec(**tracking))


def history(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


# --- 1. concurrent first use of a fresh store ------------------------------------------------------


@pytest.mark.slow  # CI budget; concurrent first opens: tests/hydra_plugins/test_shared_store.py
@pytest.mark.parametrize("round_", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_four_runs_started_at_once_on_a_fresh_sqlite_store_all_finish(tmp_path: Path, round_: int) -> None:
    procs = [worker(tmp_path, f"run{i}") for i in range(4)]
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    finished = sum(rc == 0 for rc, _ in outcomes)
    print(f"round {round_}: {finished}/4 concurrent first runs finished")
    assert finished == 4, [err.strip().splitlines()[-1:] for rc, err in outcomes if rc]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("runner")
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 4
    assert all(history(client, r.info.run_id, "loss") == [0, 1, 2, 3, 4] for r in runs)


def test_a_store_lock_held_by_another_process_delays_the_start_rather_than_failing_it(tmp_path: Path, store: str) -> None:
    spec = spec_at(tmp_path)
    tracker = build_tracker(spec)
    released = threading.Event()

    def hold_lock() -> None:  # flock locks of two open files conflict even inside one process
        with store_lock(spec.tracking.uri):
            time.sleep(1.5)
            released.set()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    time.sleep(0.2)
    tracker.start(spec)
    assert released.is_set()
    tracker.finish("FINISHED")
    holder.join()
    assert MlflowClient(spec.tracking.uri).get_run(tracker.run_id).info.status == "FINISHED"


# --- 2. kills lose no metric; a resumed run logs every step once ------------------------------------


def test_a_killed_run_keeps_its_flushed_metrics_and_its_resume_logs_every_step_once(tmp_path: Path, store: str) -> None:
    killed = worker(tmp_path, "run", first=0, last=19, kill_after=9)  # checkpoint after step 9, killed at 12
    out, err = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, err
    run_id = out.split()[1]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert set(history(client, run_id, "loss")) >= set(range(10))  # every step up to the checkpoint

    resumed = worker(tmp_path, "run", first=10, last=19, resume=run_id)  # from the checkpoint of step 9
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    for key in ("loss", "lr"):
        assert history(client, run_id, key) == list(range(20))  # each step exactly once
    assert client.get_run(run_id).info.status == "FINISHED"


def test_metrics_sent_from_the_async_queue_are_all_stored_by_flush(tmp_path: Path, store: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("runner.tracking.tracker._FLUSH_EVERY_S", 0.0)  # every call hands a batch to MLflow's queue
    spec = spec_at(tmp_path)
    tracker = build_tracker(spec)
    tracker.start(spec)
    for step in range(50):
        tracker.log_metrics({"loss": float(step)}, step)
    tracker.flush()
    client = MlflowClient(spec.tracking.uri)
    assert history(client, tracker.run_id, "loss") == list(range(50))
    tracker.finish("FINISHED")


# --- 3. a failure after the run exists ends it FAILED ---------------------------------------------------


def test_a_read_only_artifact_location_fails_in_one_line_before_any_run_exists(tmp_path: Path, read_only_dir: Path, store: str) -> None:
    spec = spec_at(tmp_path, artifact_root=str(read_only_dir / "artifacts"))
    with pytest.raises(SpecError) as error:
        build_tracker(spec).start(spec)
    message = str(error.value)
    print(message)
    assert message.startswith("tracking.artifact_root: ") and str(read_only_dir) in message and "\n" not in message
    client = MlflowClient(spec.tracking.uri)
    experiment = client.get_experiment_by_name("runner")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []


def test_an_existing_experiment_whose_artifact_location_turned_read_only_fails_before_a_run(
        tmp_path: Path, read_only_dir: Path, store: str) -> None:
    spec = spec_at(tmp_path)
    client = MlflowClient(spec.tracking.uri)
    experiment = client.create_experiment("runner", artifact_location=read_only_dir.as_uri())
    with pytest.raises(SpecError, match=r"^tracking\.artifact_root: .*read-only"):
        build_tracker(spec).start(spec)
    assert client.search_runs([experiment]) == []


def test_finish_ends_the_run_failed_even_when_its_last_metrics_cannot_be_stored(tmp_path: Path, store: str) -> None:
    spec = spec_at(tmp_path)
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.log_metrics({"loss": 1.0}, 0)
    tracker.log_metrics({"a metric named <like this>": 1.0}, 1)  # MLflow refuses this key when it is sent
    with pytest.raises(Exception):
        tracker.finish("FINISHED")
    run = MlflowClient(spec.tracking.uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED"


def test_a_run_interrupted_while_its_start_sets_up_ends_killed_not_failed(tmp_path: Path, store: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's trial gets SIGTERM (a KeyboardInterrupt) when its sweep dies; one that came just after the
    run's mlflow_run_id file was written, while the writer started, ended the run FAILED (the flaky
    test_a_killed_sweep_takes_its_trials_along_and_study_and_mlflow_agree waits for exactly that file)."""
    spec = spec_at(tmp_path)
    tracker = build_tracker(spec)

    def interrupted() -> None:
        raise KeyboardInterrupt("signal 15: the sweep is gone")

    monkeypatch.setattr(tracker, "_open_writer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tracker.start(spec)
    assert (tmp_path / "run" / "mlflow_run_id").read_text() == tracker.run_id
    assert MlflowClient(spec.tracking.uri).get_run(tracker.run_id).info.status == "KILLED"


# --- 4. bad tracking input: one line, quickly --------------------------------------------------------


def test_an_unreachable_tracking_server_is_one_line_from_the_cli(tmp_path: Path) -> None:
    started = time.perf_counter()
    out = run_cli(["tracking.uri=http://127.0.0.1:1", "trainer.max_steps=1", "trainer.progress_bar=off"], cwd=tmp_path,
                  timeout=150)
    seconds = time.perf_counter() - started
    print(f"unreachable server: exit {out.returncode} after {seconds:.1f} s (CLI, torch import included)")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: tracking.uri: no MLflow tracking server answers at "), lines
    assert "mlflow server" in lines[0]


def test_check_tracking_answers_an_unreachable_server_at_once_and_a_slow_one_patiently() -> None:
    started = time.perf_counter()
    with pytest.raises(SpecError, match=r"^tracking\.uri: no MLflow tracking server answers at http://127\.0\.0\.1:1 "):
        check_tracking(TrackingSpec(uri="http://127.0.0.1:1"))
    print(f"probe of an unreachable server: {time.perf_counter() - started:.2f} s")

    class SlowHealth(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(1.0)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args) -> None: ...

    server = http.server.HTTPServer(("127.0.0.1", 0), SlowHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_tracking(TrackingSpec(uri=f"http://127.0.0.1:{server.server_port}"))
    finally:
        server.shutdown()


@pytest.mark.parametrize("uri", ["sqlit:///outputs/mlflow.db", "ftp://example.org/mlflow", "nonsense:thing"])
def test_a_malformed_tracking_uri_is_one_line(uri: str) -> None:
    with pytest.raises(SpecError) as error:
        check_tracking(TrackingSpec(uri=uri))
    assert str(error.value).startswith(f"tracking.uri: {uri!r} has an unknown scheme") and "\n" not in str(error.value)


def test_a_read_only_sqlite_store_is_one_line(tmp_path: Path, read_only_dir: Path) -> None:
    for uri in (f"sqlite:///{read_only_dir}/new.db", f"sqlite:///{read_only_dir}/sub/new.db"):
        with pytest.raises(SpecError, match=r"^tracking\.uri: cannot write the MLflow store .*: .* is read-only; ") as error:
            check_tracking(TrackingSpec(uri=uri, artifact_root=str(tmp_path / "artifacts")))
        assert "\n" not in str(error.value)


def test_an_existing_sqlite_store_that_turned_read_only_is_one_line_from_the_tracker(tmp_path: Path, store: str) -> None:
    spec = spec_at(tmp_path)
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.finish("FINISHED")
    with read_only_view(tmp_path, tmp_path / "view") as view:  # the same files, mounted read-only
        spec = spec_at(tmp_path, uri=f"sqlite:///{view}/mlflow.db")
        with pytest.raises(SpecError) as error:
            build_tracker(spec).start(spec)
    print(error.value)
    assert str(error.value).startswith(f"tracking.uri: the MLflow store {view}/mlflow.db is read-only; ")


def test_a_full_disk_is_named_with_its_path(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with mounted_tmpfs(disk, "size=256k"):
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        with pytest.raises(SpecError, match=rf"^tracking\.uri: disk full: .*{disk}"):
            check_tracking(TrackingSpec(uri=f"sqlite:///{disk}/mlflow.db", artifact_root=str(tmp_path / "a")))
        with pytest.raises(SpecError, match=rf"^tracking\.artifact_root: disk full: .*{disk}"):
            check_tracking(TrackingSpec(uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(disk / "a")))


def test_check_tracking_imports_neither_torch_nor_mlflow() -> None:
    code = ("import sys; from runner.tracking.mlflow_store import check_tracking; from runner.specs.tracking import TrackingSpec; "
            "check_tracking(TrackingSpec()); print('torch' in sys.modules, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.split() == ["False", "False"], out.stderr


# --- 5. ranking runs: summary metrics; the UI opens on runs -------------------------------------------


def test_summary_metrics_rank_runs_by_their_best_not_their_last_value(tmp_path: Path, store: str) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for name, curve in (("peaks-early", [0.5, 0.95, 0.6]), ("steady", [0.7, 0.8, 0.85])):
        spec = spec_at(tmp_path, run=name, run_name=name)
        tracker = build_tracker(spec)
        tracker.start(spec)
        for step, acc in enumerate(curve):
            tracker.log_metrics({"val/acc": acc}, step)
        tracker.log_summary(max(curve), {"val/acc": max(curve)}, step=len(curve) - 1)
        tracker.finish("FINISHED")
    experiment = client.get_experiment_by_name("runner")
    by_last = client.search_runs([experiment.experiment_id], order_by=["metrics.`val/acc` DESC"])
    by_objective = client.search_runs([experiment.experiment_id], order_by=["metrics.objective DESC"])
    assert by_last[0].info.run_name == "steady"  # the column the table shows by default misleads
    assert by_objective[0].info.run_name == "peaks-early"
    assert by_objective[0].data.metrics[best_key("val/acc")] == 0.95


def test_runner_experiments_are_marked_as_model_training_new_and_existing(tmp_path: Path, store: str) -> None:
    spec = spec_at(tmp_path)
    client = MlflowClient(spec.tracking.uri)
    old = client.create_experiment("made-elsewhere", artifact_location=(tmp_path / "a").as_uri())
    for name in ("runner", "made-elsewhere"):
        named = spec.replace(run_dir=str(tmp_path / name), tracking=TrackingSpec(uri=spec.tracking.uri, artifact_root=spec.tracking.artifact_root,
                                                   experiment=name))
        tracker = build_tracker(named)
        tracker.start(named)
        tracker.finish("FINISHED")
        assert client.get_experiment_by_name(name).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING


# --- 6, 7. tracebacks, runs left RUNNING, the protocol ---------------------------------------------


def test_log_text_stores_a_traceback_with_the_run(tmp_path: Path, store: str) -> None:
    spec = spec_at(tmp_path)
    tracker = build_tracker(spec)
    tracker.start(spec)
    trace = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: boom\n"
    tracker.log_text(trace, "traceback.txt")
    tracker.finish("FAILED")
    client = MlflowClient(spec.tracking.uri)
    path = client.download_artifacts(tracker.run_id, "traceback.txt", str(tmp_path / "down"))
    assert Path(path).read_text() == trace
    assert client.get_run(tracker.run_id).info.status == "FAILED"


def test_end_left_running_ends_a_killed_workers_run(tmp_path: Path, store: str) -> None:
    killed = worker(tmp_path, "run", first=0, last=5, kill_after=1)
    out, _ = killed.communicate(timeout=300)
    run_id = out.split()[1]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(run_id).info.status == "RUNNING"
    spec = RunSpec(run_dir=str(tmp_path / "run"),
                   tracking=TrackingSpec(uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "artifacts")))
    end_left_running(spec, "FAILED")
    assert client.get_run(run_id).info.status == "FAILED"
    (tmp_path / "run" / "mlflow_run_id").write_text("0" * 32)  # a run the store does not hold: nothing to end
    end_left_running(spec, "FAILED")


def test_every_tracker_offers_the_whole_protocol() -> None:
    wanted = {name for name in vars(Tracker) if not name.startswith("_") and callable(getattr(Tracker, name))}
    assert {"flush", "log_summary", "log_text"} <= wanted
    for cls in (NullTracker, MlflowTracker):
        assert wanted <= set(dir(cls)), wanted - set(dir(cls))
    NullTracker().flush()


# --- fixtures: read-only and full file systems, for root too (root ignores permission bits) -----------


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"needs a tmpfs mount (root in a container that allows it): {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only_view(source: Path, view: Path):
    """source's files at view, read-only: a read-only bind mount for root, permission bits otherwise."""
    if os.geteuid() != 0:
        shutil.copytree(source, view, ignore=shutil.ignore_patterns(view.name))
        for path in (view / "mlflow.db", view):
            path.chmod(0o444 if path.is_file() else 0o555)
        yield view
        view.chmod(0o755)
        return
    view.mkdir()
    for args in (["--bind", str(source), str(view)], ["-o", "remount,bind,ro", str(view)]):
        mount = subprocess.run(["mount", *args], capture_output=True, text=True)
        if mount.returncode != 0:
            subprocess.run(["umount", "-l", str(view)], capture_output=True)
            pytest.skip(f"needs a read-only bind mount: {mount.stderr.strip()}")
    try:
        yield view
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True)


@pytest.fixture
def read_only_dir(tmp_path: Path):
    path = tmp_path / "read-only"
    if os.geteuid() != 0:
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    with mounted_tmpfs(path, "ro,size=64k"):
        yield path


# --- 6. params and run names (issue 13) ----------------------------------------------------------------


def test_params_with_globs_and_dotted_keys_are_logged_and_read_back(tmp_path: Path, store: str) -> None:
    """README's `optimizer.lr_multipliers={backbone.*: 0.1}` made every tracked run fail: a glob is no MLflow key."""
    import json

    from tests.conftest import compose_spec

    multipliers = {"backbone.*": 0.1, "head.?": 2.0}
    extra = {"x.y": 1, "x": {"y": 2}}  # flattened naively, both would be `model.extra.x.y`
    spec = compose_spec(["optimizer.lr_multipliers={backbone.*: 0.1, head.?: 2}",
                         "+model.extra={x.y: 1, x: {y: 2}}"], tmp_path / "run", tracking_uri=store)
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.finish("FINISHED")
    run = MlflowClient(store).get_run(tracker.run_id)
    params = run.data.params
    assert run.info.status == "FINISHED"
    assert json.loads(params["optimizer.lr_multipliers"]) == multipliers
    assert json.loads(params["model.extra"]) == extra
    assert params["optimizer.lr"] == str(spec.optimizer.lr) and params["model.hidden"] == "[256, 128]"
    assert params == params_of(spec) and len(params) == len(set(params))


def test_run_names_leave_out_overrides_that_do_not_change_what_is_trained() -> None:
    overrides = ("optimizer=adamw", "tracking.artifact_root=/tmp/a", "tracking.uri=sqlite:///x.db", "tracking=mlflow",
                 "hydra.run.dir=/tmp/run", "hydra/launcher=basic", "trainer.progress_bar=off", "trainer.resume=/tmp/r",
                 "trainer.log_every_n_steps=5", "dataset.num_workers=2", "+accum=4", "optimizer.lr=0.01",
                 "trial.number=3", "parallelism.rdzv_endpoint=h:1")
    assert run_name_from(overrides) == "adamw,accum=4,lr=0.01"
    assert run_name_from(("tracking.artifact_root=/tmp/a",)) == "default"


def test_another_applications_sqlite_file_is_refused_before_mlflow_writes_its_tables_into_it(tmp_path: Path) -> None:
    import sqlite3

    other = tmp_path / "notes.db"
    with contextlib.closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
        db.execute("INSERT INTO notes (text) VALUES ('keep me')")
        db.commit()
    before = other.read_bytes()
    proc = run_cli([f"tracking.uri=sqlite:///{other}", "trainer.max_steps=1"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: tracking.uri: {other} is a sqlite database of another application (its "
                                   "tables: notes), not an MLflow store; point tracking.uri at a new file or an MLflow "
                                   "store")
    assert other.read_bytes() == before  # no table of MLflow's written into it
    assert not (tmp_path / "outputs").exists()


def test_a_sqlite_store_in_a_folder_that_does_not_exist_is_refused_but_the_defaults_folder_is_made(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(SpecError) as refused:
        check_tracking(TrackingSpec(uri=f"sqlite:///{missing}/mlflow.db"))
    assert str(refused.value) == (f"tracking.uri: the folder {missing} does not exist; create it (mkdir -p {missing}) or "
                                  "point tracking.uri at a file in an existing folder")
    assert not missing.exists()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # the default, sqlite:///outputs/mlflow.db, on a fresh clone: outputs/ is made when the store opens
        check_tracking(TrackingSpec())
    finally:
        os.chdir(cwd)


def test_a_run_is_not_taken_for_gone_while_its_sqlite_store_is_locked_past_the_busy_timeout(tmp_path: Path) -> None:
    """Issue 35 item 12: a sweep asks whether its study's parent run still exists before it reopens it; a store
    locked by other writers for longer than MLflow's 20 s sqlite busy timeout answered "no", and the sweep opened a
    second parent run for the study. Only the store's "no such run" may mean gone."""
    from runner.tracking.tracker import run_exists

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("sweep")).info.run_id
    assert not run_exists(client, "0" * 32)

    holder = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")  # what four racing sweeps' writes do to a reader under load, for 22 s
    release = threading.Timer(22.0, lambda: holder.execute("ROLLBACK"))
    release.start()
    try:
        assert run_exists(client, run_id)
        assert not release.is_alive()  # the answer came after the lock, not from around it
    finally:
        release.cancel()
        release.join()
        holder.close()
