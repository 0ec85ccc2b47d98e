"""The MLflow UI, in a real headless browser, opens a runner experiment on its runs table.

MLflow 3 opens experiments on its GenAI view (traces, token usage) unless told otherwise; runner marks
its experiments as model training and prints a link to the runs table. Needs chromium and playwright:
`apt-get install -y chromium; pip install playwright` (never `playwright install`: the system
chromium is used).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from runner.mlflow_store import EXPERIMENT_KIND_TAG, MODEL_TRAINING, experiment_page
from runner.spec import RunSpec, TrackingSpec
from runner.tracking import build_tracker

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
INSTALL = "apt-get install -y chromium; pip install playwright"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, server: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited with {server.returncode}: {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"mlflow server did not answer at {url} within {seconds:.0f} s")


def test_the_ui_opens_a_runner_experiment_on_its_runs_table(tmp_path: Path) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"needs {CHROMIUM}: {INSTALL}")
    playwright = pytest.importorskip("playwright.sync_api", reason=f"needs playwright: {INSTALL}")

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = RunSpec(run_dir=str(tmp_path / "run"),
                   tracking=TrackingSpec(uri=uri, artifact_root=str(tmp_path / "artifacts"), run_name="ui-check-run"))
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.log_metrics({"val/acc": 0.5}, 1)
    tracker.log_summary(0.5, {"val/acc": 0.5}, 1)
    tracker.finish("FINISHED")
    experiment = MlflowClient(uri).get_experiment_by_name("runner")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
    server = subprocess.Popen([mlflow, "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        wait_for_health(base, server)
        page_url = experiment_page(base, experiment.experiment_id)
        local_link = experiment_page("http://127.0.0.1:5000", experiment.experiment_id)
        assert local_link in tracker.describe()  # what a user is told to open
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(page_url)
                page.get_by_text("ui-check-run").first.wait_for(timeout=90_000)
                body = page.inner_text("body")
                print(f"opened {page.url}")
            finally:
                browser.close()
        assert "ui-check-run" in body and "Run Name" in body  # the runs table
        assert "Token Usage" not in body  # not the GenAI overview
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
