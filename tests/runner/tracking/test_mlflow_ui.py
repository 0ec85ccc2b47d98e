"""The MLflow UI, in a real headless browser, opens a runner experiment on its runs table.

MLflow 3.17 opens experiments on its GenAI view (traces, token usage) unless the browser's
"GenAI | Model training" switch says otherwise; `make ui` (runner.tracking.mlflow_ui) starts that switch on
model training, and runner stores saved views (columns, order) in the experiment. One server and one
browser serve every check here; each check opens a fresh browser context (no localStorage), as a
new user would. Needs chromium and playwright: `apt-get install -y chromium; pip install playwright`
(never `playwright install`: the system chromium is used).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from mlflow.tracking import MlflowClient

from runner.tracking.mlflow_store import (BEST_VIEW, best_view, EXPERIMENT_KIND_TAG, MODEL_TRAINING, RUNS_VIEW, VIEW_TAG_PREFIX,
                                 experiment_page)
from runner.specs.objective import ObjectiveSpec
from runner.specs.run import RunSpec
from runner.specs.tracking import TrackingSpec
from runner.tracking.tracker import best_key, build_tracker

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
INSTALL = "apt-get install -y chromium; pip install playwright"
WAIT_MS = 90_000  # a loaded machine renders the first page slowly
# A page load costs ~7 s: in CI (-m "not slow") test_a_bookmark_of_the_experiment_opens_its_runs_table keeps the
# server, its model-training preset and the runs table, test_runner_stores_its_views_in_the_experiment the views.
BROWSER_SLOW = pytest.mark.slow
# name -> (objective metric, direction, each trial's objective: the true best is the lowest / highest)
EXPERIMENTS = {"ui-min": ("val/loss", "minimize", {"trial-a": 0.3, "trial-b": 0.1, "trial-c": 0.2}),
               "ui-max": ("val/acc", "maximize", {"trial-a": 0.7, "trial-b": 0.6, "trial-c": 0.9})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, server: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the UI server exited with {server.returncode}: {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the UI server did not answer at {url} within {seconds:.0f} s")


def spec_for(tmp: Path, experiment: str, name: str) -> RunSpec:
    metric, direction, _ = EXPERIMENTS[experiment]
    return RunSpec(run_dir=str(tmp / experiment / name), objective=ObjectiveSpec(metric=metric, direction=direction),
                   tracking=TrackingSpec(uri=f"sqlite:///{tmp}/mlflow.db", experiment=experiment,
                                         artifact_root=str(tmp / "artifacts"), run_name=name))


def log_study(tmp: Path, experiment: str) -> dict[str, str]:
    """A parent run (a study) and three trials with curves and a summary, through runner's tracker;
    run name -> run id, and "told" -> what the study's run told the user (its trials name only themselves)."""
    metric, _, objectives = EXPERIMENTS[experiment]
    parent = build_tracker(spec_for(tmp, experiment, "study"))
    parent.start(spec_for(tmp, experiment, "study"))
    ids = {"study": parent.run_id}
    for name, objective in objectives.items():
        spec = spec_for(tmp, experiment, name)
        tracker = build_tracker(spec, parent_run_id=parent.run_id)
        tracker.start(spec)
        for step in range(4):
            tracker.log_metrics({"train/loss": 2.0 - step * 0.2}, step)
            tracker.log_metrics({"val/loss": 1.0 - step * 0.1, "val/acc": 0.5 + step * 0.05, metric: objective
                                 + (3 - step) * (0.1 if metric == "val/loss" else -0.1)}, step)
        tracker.log_summary(objective, {metric: objective}, 3)
        tracker.finish("FINISHED")
        ids[name] = tracker.run_id
        assert "see it with" not in tracker.describe()  # once per command, by the parent (issue 26)
    parent.finish("FINISHED")
    ids["told"] = parent.describe()
    return ids


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two experiments (a minimized and a maximized objective), each a study of three trials."""
    tmp = tmp_path_factory.mktemp("ui")
    uri = f"sqlite:///{tmp}/mlflow.db"
    runs = {experiment: log_study(tmp, experiment) for experiment in EXPERIMENTS}
    client = MlflowClient(uri)
    ids = {name: client.get_experiment_by_name(name).experiment_id for name in EXPERIMENTS}
    return {"uri": uri, "runs": runs, "ids": ids, "client": client}


@pytest.fixture(scope="module")
def ui(store: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`make ui`'s server over the store, and a headless chromium."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"needs {CHROMIUM}: {INSTALL}")
    playwright = pytest.importorskip("playwright.sync_api", reason=f"needs playwright: {INSTALL}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "runner.tracking.mlflow_ui", "--backend-store-uri", store["uri"],
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        wait_for_health(base, server)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield {**store, "base": base, "browser": browser}
            finally:
                browser.close()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def fresh_page(ui: dict[str, Any]) -> Any:
    """A page in a new browser context: no localStorage, as in a browser that never opened MLflow."""
    return ui["browser"].new_context(viewport={"width": 1600, "height": 1000}).new_page()


def assert_runs_table(page: Any, columns: tuple[str, ...] = ("objective", "val/loss", "val/acc", "train/loss")) -> None:
    """The page is the runs table (not GenAI's overview or traces), the objective and main metrics its columns."""
    page.get_by_text("Run Name").first.wait_for(timeout=WAIT_MS)
    page.get_by_role("link", name="study", exact=True).wait_for(timeout=WAIT_MS)
    assert re.search(r"/experiments/\d+/runs\?", page.url), page.url
    assert "Token Usage" not in page.inner_text("body")
    headers = [h.strip() for h in page.locator("[role=columnheader]").all_inner_texts()]
    assert set(columns) <= set(headers), headers


def run_rows(page: Any) -> list[str]:
    """The run names of the table's rows, top to bottom."""
    rows = []
    for row in page.locator("div[role=row][row-index]").all():
        link = row.locator("a[href*='/runs/']")
        if link.count():
            rows.append((int(row.get_attribute("row-index")), link.first.inner_text()))
    return [name for _, name in sorted(rows)]


def test_a_bookmark_of_the_experiment_opens_its_runs_table(ui: dict[str, Any]) -> None:
    page = fresh_page(ui)
    page.goto(f"{ui['base']}/#/experiments/{ui['ids']['ui-min']}")
    assert_runs_table(page)


@BROWSER_SLOW
def test_the_experiment_list_opens_the_runs_table(ui: dict[str, Any]) -> None:
    page = fresh_page(ui)
    page.goto(f"{ui['base']}/#/experiments")
    page.get_by_role("link", name="ui-min", exact=True).click(timeout=WAIT_MS)
    assert_runs_table(page)


@BROWSER_SLOW
def test_the_printed_link_shows_the_objective_and_main_metrics_with_children_nested(ui: dict[str, Any]) -> None:
    experiment = ui["ids"]["ui-min"]
    page = fresh_page(ui)
    page.goto(experiment_page(ui["base"], experiment))  # the link each run prints (see the last test)
    assert_runs_table(page)
    assert run_rows(page) == ["study"]  # the trials are under their parent, not beside it
    parent = page.locator("div[role=row]", has=page.get_by_role("link", name="study", exact=True))
    parent.locator("button[data-component-id$='runnamecellrenderer.tsx_46']").click()  # the row's expander
    page.get_by_role("link", name="trial-a", exact=True).wait_for(timeout=WAIT_MS)
    assert run_rows(page) == ["study", "trial-c", "trial-b", "trial-a"]  # newest first, under the parent


@BROWSER_SLOW
@pytest.mark.parametrize("experiment", list(EXPERIMENTS))
def test_sorting_by_objective_puts_the_best_run_first(ui: dict[str, Any], experiment: str) -> None:
    metric, direction, objectives = EXPERIMENTS[experiment]
    logged = {name: ui["client"].get_run(ui["runs"][experiment][name]).data.metrics for name in objectives}
    assert {name: m["objective"] for name, m in logged.items()} == objectives
    assert all(m[best_key(metric)] == objectives[name] for name, m in logged.items())
    truly_best = (max if direction == "maximize" else min)(objectives, key=objectives.get)
    page = fresh_page(ui)
    page.goto(experiment_page(ui["base"], ui["ids"][experiment], best_view(metric)))
    page.wait_for_url(re.compile(r"orderByKey=metrics.%60objective%60"), timeout=WAIT_MS)
    page.get_by_role("link", name="trial-a", exact=True).wait_for(timeout=WAIT_MS)
    rows = run_rows(page)
    assert rows[0] == truly_best, rows
    assert rows == sorted(objectives, key=objectives.get, reverse=direction == "maximize") + ["study"]


@BROWSER_SLOW
def test_a_run_page_opens_on_its_curves_and_its_breadcrumb_leads_to_the_runs(ui: dict[str, Any]) -> None:
    experiment, run = ui["ids"]["ui-min"], ui["runs"]["ui-min"]["trial-b"]
    page = fresh_page(ui)
    page.goto(f"{ui['base']}/#/experiments/{experiment}/runs/{run}/model-metrics")  # as the table links it
    page.get_by_text("trial-b (train/loss)").wait_for(timeout=WAIT_MS)
    charts = re.findall(r"trial-b \(([^)]+)\)", page.inner_text("body"))
    assert charts[:3] == ["train/loss", "val/acc", "val/loss"], charts  # curves first, summaries after
    crumb = page.locator("a[data-testid=experiment-observatory-link-runs]")
    assert crumb.inner_text().strip() == "Runs"  # not "Evaluations" (GenAI)
    crumb.click()
    assert_runs_table(page)


def test_runner_stores_its_views_in_the_experiment(store: dict[str, Any]) -> None:
    """Without a browser: the experiment holds the saved views the link opens, with the run's metrics
    and its objective's direction, and is marked as model training (MLflow before 3.17 reads that)."""
    experiment = store["client"].get_experiment(store["ids"]["ui-min"])
    assert experiment.tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING
    best = best_view("val/loss")  # one "best first" view per objective (issue 26, section 4)
    views = {view: json.loads(experiment.tags[VIEW_TAG_PREFIX + view]) for view in (RUNS_VIEW, best)}
    states = {view: json.loads(envelope["state"]) for view, envelope in views.items()}
    assert states[best]["orderByKey"] == "metrics.`objective`" and states[best]["orderByAsc"] is True
    assert states[RUNS_VIEW]["orderByKey"] == "attributes.start_time" and states[RUNS_VIEW]["orderByAsc"] is False
    assert states[RUNS_VIEW]["selectedColumns"][:2] == ["metrics.`objective`", "metrics.`val/loss`"]
    assert {"metrics.`val/acc`", "metrics.`train/loss`"} <= set(states[RUNS_VIEW]["selectedColumns"])
    assert views[RUNS_VIEW]["name"] and views[RUNS_VIEW]["createdAt"] > views[best]["createdAt"]  # listed first
    maximized = json.loads(json.loads(store["client"].get_experiment(store["ids"]["ui-max"]).tags[
        VIEW_TAG_PREFIX + best_view("val/acc")])["state"])
    assert maximized["orderByAsc"] is False and maximized["selectedColumns"][1] == "metrics.`val/acc`"
    link = experiment_page("http://127.0.0.1:5000", experiment.experiment_id)
    assert link.endswith(f"/runs?workflowType=machine_learning&viewStateShareKey={RUNS_VIEW}")
    assert link in store["runs"]["ui-min"]["told"]  # what a user is told to open


def test_each_objective_keeps_its_own_best_first_view(tmp_path: Path, migrated_mlflow_store: Path) -> None:
    """A classifier's run, then a language model's in the same experiment (before: the second rewrote the one
    "best objective first" view: ascending, worst classifier first, val/acc gone from its columns): each
    objective's view sorts and shows its own runs; the newest-first view keeps both runs' columns."""
    import shutil

    from mlflow.tracking import MlflowClient

    from runner.tracking.mlflow_store import saved_views, store_views

    shutil.copy(migrated_mlflow_store, tmp_path / "mlflow.db")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("mixed")
    store_views(client, experiment, saved_views(["objective", "val/acc", "train/loss"], True, "val/acc"))
    store_views(client, experiment, saved_views(["objective", "val/loss", "val/perplexity", "train/loss"], False, "val/loss"))
    tags = client.get_experiment(experiment).tags
    state = {view: json.loads(json.loads(tags[VIEW_TAG_PREFIX + view])["state"])
             for view in (RUNS_VIEW, best_view("val/acc"), best_view("val/loss"))}
    classifiers, models = state[best_view("val/acc")], state[best_view("val/loss")]
    assert classifiers["orderByAsc"] is False and "metrics.`val/acc`" in classifiers["selectedColumns"]
    assert classifiers["searchFilter"] == "params.`objective.metric` = 'val/acc'"
    assert models["orderByAsc"] is True and models["searchFilter"] == "params.`objective.metric` = 'val/loss'"
    assert state[RUNS_VIEW]["selectedColumns"] == ["metrics.`objective`", "metrics.`val/acc`", "metrics.`train/loss`",
                                                   "metrics.`val/loss`", "metrics.`val/perplexity`"]
    assert json.loads(tags[VIEW_TAG_PREFIX + best_view("val/acc")])["name"] == "runner: best val/acc first"
