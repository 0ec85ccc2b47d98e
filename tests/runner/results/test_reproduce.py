"""The run record, `runner reproduce` and `runner compare`, in this process against real MLflow stores."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from runner.results import compare, reproduce

from runner.tracking import run_record
from runner.cli.launch import run
from tests.conftest import REPO, compose_spec

TINY = ["trainer.max_steps=3", "trainer.deterministic=true", "trainer.device=cpu", "trainer.progress_bar=off",
        "trainer.memory_estimate=false"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_run_records_commit_diff_packages_hardware_and_reproduce_reruns_it_to_equal_metrics(
        tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    work = tmp_path / "work"  # the user's project: a git repository with an uncommitted change
    work.mkdir()
    git(work, "init", "-q")
    (work / "train_notes.py").write_text("lr = 0.1\n")
    git(work, "add", ".")
    git(work, "commit", "-qm", "first")
    first = git(work, "rev-parse", "HEAD")
    (work / "train_notes.py").write_text("lr = 0.2  # uncommitted\n")
    monkeypatch.chdir(work)

    run(compose_spec(TINY, tmp_path / "run", store))
    client = MlflowClient(store)
    (original,) = client.search_runs(["1"])
    tags, run_id = original.data.tags, original.info.run_id
    assert tags["git_commit"] == first and tags["git_dirty"] == "true"
    assert tags["version.torch"] == metadata.version("torch") and tags["version.mlflow"] == metadata.version("mlflow")
    assert tags["hardware.gpus"] == "none" or tags["hardware.cuda"] != "none"
    assert tags["data.kind"].startswith("built-in")
    assert tags["runner.source_commit"] == git(REPO, "rev-parse", "HEAD")  # runner's own checkout is another repo
    diff = Path(client.download_artifacts(run_id, run_record.DIFF_FILE, str(tmp_path))).read_text()
    assert "+lr = 0.2  # uncommitted" in diff and "-lr = 0.1" in diff
    record = json.loads(Path(client.download_artifacts(run_id, run_record.RECORD_FILE, str(tmp_path))).read_text())
    assert record["packages"]["numpy"] == metadata.version("numpy")
    assert record["data"]["params"]["_target_"] == "runner.data.digits.build" and record["data"]["paths"] == {}

    git(work, "commit", "-qam", "second")  # the code moved on: reproduce must say so before it reruns
    second = git(work, "rev-parse", "HEAD")
    capsys.readouterr()
    client.log_metric(run_id, "test/acc", -1.0, step=10**6)  # the original's final test/acc, as if it had differed
    assert reproduce.main([run_id, "--uri", store, "--run-dir", str(tmp_path / "again")]) == 1
    out = capsys.readouterr().out
    found = [line for line in out.splitlines() if line.startswith("  differs:")]
    assert found[:2] == [f"  differs: git commit: {first} then, {second} now",
                         f"  differs: uncommitted changes (sha256 of git diff HEAD): {record['git']['diff_sha256']} "
                         f"then, None now"]
    assert out.index("differs: git commit") < out.index("final metric")

    (again,) = [r for r in client.search_runs(["1"]) if r.info.run_id != run_id]
    assert again.data.tags[reproduce.TAG] == run_id
    trained = {k: v for k, v in original.data.metrics.items() if not k.startswith(reproduce.TIMING_PREFIXES)}
    assert {"objective", "val/loss", "test/acc", "train/loss"} <= set(trained)
    assert {k: again.data.metrics[k] for k in trained} == trained  # deterministic on a CPU: exactly equal
    assert f"{len(trained) - 1} of {len(trained)} final metrics equal" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("test/acc ")] == ["DIFFERS"]
    assert out.rstrip().endswith("reproduce: 1 final metric(s) differ: test/acc")


def test_reproducing_an_evaluation_evaluates_the_same_weights_again(tmp_path: Path, store: str,
                                                                    capsys: pytest.CaptureFixture) -> None:
    """An eval run's spec names the weights file and average it took: the rerun takes them again (it was
    refused: a rerun dropped trainer.resume)."""
    from runner.tracking.tracker import RUN_FILE

    # lr 0.3 overshoots: the best validation (step 2) is not the last (step 6)
    run(compose_spec([*TINY, "trainer.max_steps=6", "model.hidden=[16]", "dataset.batch_size=256", "optimizer.lr=0.3",
                      "trainer.eval_every_n_steps=2", "trainer.eval_every_epoch=false"], tmp_path / "src", store))
    run(compose_spec(["mode=eval", f"trainer.resume={tmp_path / 'src'}"], tmp_path / "eval", store))
    evaluated = (tmp_path / "eval" / RUN_FILE).read_text().strip()
    client = MlflowClient(store)
    original = client.get_run(evaluated)
    assert original.data.tags["runner.evaluated_weights"] == "best@step 2"
    capsys.readouterr()
    assert reproduce.main([evaluated, "--uri", store, "--run-dir", str(tmp_path / "again")]) == 0
    again = client.get_run((tmp_path / "again" / RUN_FILE).read_text().strip())
    assert again.data.tags[reproduce.TAG] == evaluated
    assert again.data.tags["runner.evaluated_checkpoint"] == original.data.tags["runner.evaluated_checkpoint"]
    assert again.data.metrics == original.data.metrics and "val/acc" in again.data.metrics
    assert f"{len(original.data.metrics)} of {len(original.data.metrics)} final metrics equal" in capsys.readouterr().out


def test_a_changed_data_file_or_folder_is_a_difference(tmp_path: Path) -> None:
    table = tmp_path / "train.csv"
    table.write_text("text,label\nhello,0\nworld,1\n")
    folder = tmp_path / "images"
    (folder / "cat").mkdir(parents=True)
    (folder / "cat" / "a.png").write_bytes(b"x" * 10)
    spec = compose_spec(["dataset=text_classification", f"dataset.train_file={table}", f"dataset.root={folder}"],
                        tmp_path / "run")
    then = run_record.build(spec)
    assert then["data"]["paths"][f"train_file:{table}"]["bytes"] == table.stat().st_size
    assert then["data"]["paths"][f"root:{folder}"]["files"] == 1
    assert reproduce.differences(then, run_record.build(spec)) == []
    outside = run_record.tags(run_record.build(spec, cwd=tmp_path))  # tmp_path is in no git repository
    assert outside["git_commit"] == f"none (not a git repository: {tmp_path})" and outside["git_dirty"] == "false"

    table.write_text("text,label\nhello,1\nworld,0\n")  # same size, other labels: only the checksum tells
    (folder / "cat" / "b.png").write_bytes(b"y" * 5)
    found = reproduce.differences(then, run_record.build(spec))
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in found] == [
        f"data root:{folder}", f"data train_file:{table}"]
    assert '"bytes": 15, "files": 2' in found[0] and '"bytes": 10, "files": 1' in found[0]


def test_the_record_names_a_modules_source_by_where_its_links_lead(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A module whose file, or whose folder, is a link into an installation (site-packages) is installed code: not in
    the record's sources; one in a plain folder is, under the name it was imported by, with its checksum."""
    installed = tmp_path / "env" / "site-packages"
    installed.mkdir(parents=True)
    (installed / "linked_file_13.py").write_text("X = 1\n")
    (installed / "linked_folder_13.py").write_text("X = 2\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "plain_13.py").write_text("X = 3\n")
    (mine / "linked_file_13.py").symlink_to(installed / "linked_file_13.py")
    (tmp_path / "via").symlink_to(installed, target_is_directory=True)
    monkeypatch.syspath_prepend(str(tmp_path / "via"))
    monkeypatch.syspath_prepend(str(mine))
    for name in ("plain_13", "linked_file_13", "linked_folder_13"):
        __import__(name)
    sources = run_record.imported_sources()
    assert sources["plain_13"] == {"file": str(mine / "plain_13.py"),
                                   "sha256": hashlib.sha256(b"X = 3\n").hexdigest()}
    assert "linked_file_13" not in sources and "linked_folder_13" not in sources
    for name in ("plain_13", "linked_file_13", "linked_folder_13"):
        del sys.modules[name]


UNTRACKED_NET = """import math

from torch import nn


class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.head = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x):
        return self.head(x.flatten(1)) * {scale}
"""


def test_an_untracked_model_file_that_changed_is_a_difference(tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    """The user's model is a file git does not track (issue 22, defect 13): `git diff HEAD` misses its change, so
    the record holds the source of every module the run imported from outside site-packages, and reproduce
    names the changed one."""
    work = tmp_path / "work"
    (work / "untracked_models_13").mkdir(parents=True)
    git(work, "init", "-q")
    (work / "README").write_text("a project\n")
    git(work, "add", ".")
    git(work, "commit", "-qm", "first")
    net = work / "untracked_models_13" / "net.py"
    (work / "untracked_models_13" / "__init__.py").write_text("")
    net.write_text(UNTRACKED_NET.format(scale=1.0))
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    run(compose_spec([*TINY, "model._target_=untracked_models_13.net.Net"], tmp_path / "run", store))
    client = MlflowClient(store)
    (original,) = client.search_runs(["1"])
    record = json.loads(Path(client.download_artifacts(original.info.run_id, run_record.RECORD_FILE,
                                                       str(tmp_path))).read_text())
    assert record["git"]["diff_sha256"] is None  # git sees no change: the file is untracked
    source = record["sources"]["untracked_models_13.net"]
    assert source == {"file": str(net), "sha256": hashlib.sha256(net.read_bytes()).hexdigest()}
    assert not any("site-packages" in s["file"] for s in record["sources"].values())

    old = source["sha256"]
    net.write_text(UNTRACKED_NET.format(scale=2.0))
    new = hashlib.sha256(net.read_bytes()).hexdigest()
    capsys.readouterr()
    reproduce.main([original.info.run_id, "--uri", store, "--run-dir", str(tmp_path / "again")])
    out = capsys.readouterr().out
    assert f"reproduce: 1 difference(s) between run {original.info.run_id} and now:" in out
    assert f"  differs: source of untracked_models_13.net ({net}): {old} then, {new} now" in out


def _fake_run(client: MlflowClient, experiment: str, name: str, lr: str, objective: float | None,
              losses: list[float], parent: str | None = None, direction: str = "maximize") -> str:
    """A finished run as runner logs it: its params, `objective` and a val/loss history."""
    tags = {"mlflow.parentRunId": parent} if parent else {}
    run_id = client.create_run(experiment, run_name=name, tags=tags).info.run_id
    params = {"optimizer.lr": lr, "seed": "0", "objective.direction": direction, "run_dir": f"/tmp/{name}"}
    metrics = [Metric("val/loss", v, 0, step) for step, v in enumerate(losses)]
    if objective is not None:
        metrics.append(Metric("objective", objective, 0, len(losses)))
    client.log_batch(run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()],
                     tags=[RunTag("x", "y")])
    client.set_terminated(run_id)
    return run_id


def test_compare_ranks_runs_by_objective_with_the_differing_params_and_plots_a_metric(
        tmp_path: Path, store: str, capsys: pytest.CaptureFixture) -> None:
    client = MlflowClient(store)
    experiment = client.create_experiment("cmp")
    parent = client.create_run(experiment, run_name="sweep").info.run_id
    mid = _fake_run(client, experiment, "mid", "0.01", 0.8, [1.0, 0.7], parent)
    best = _fake_run(client, experiment, "best", "0.1", 0.9, [1.0, 0.5, 0.3], parent)
    failed = _fake_run(client, experiment, "failed", "1.0", None, [2.0], parent)
    worst = _fake_run(client, experiment, "worst", "0.001", 0.5, [1.2, 1.1], parent)

    for target in (["cmp"], [parent]):  # the experiment (its parent left out) or the parent: the same table
        assert compare.main([*target, "--uri", store]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["#", "run", "run", "id", "status", "duration", "objective", "optimizer.lr"]
        assert [line.split()[1] for line in lines[1:]] == ["best", "mid", "worst", "failed"]
        assert [line.split()[2] for line in lines[1:]] == [r[:12] for r in (best, mid, worst, failed)]
        assert lines[1].split()[-1] == "0.1" and lines[4].split()[-2:] == ["-", "1.0"]

    lower = [_fake_run(client, experiment, n, lr, v, [v], direction="minimize")
             for n, lr, v in (("b", "0.1", 0.7), ("a", "0.2", 0.2))]
    chart = tmp_path / "chart.png"
    # a run id, or its first 12 characters as the table shows them
    assert compare.main([lower[0][:12], lower[1], "tracking.uri=" + store, "--plot", "val/loss", "--out", str(chart)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[1:3]] == ["a", "b"]  # minimize: the lower objective first
    assert lines[3] == f"chart of val/loss: {chart}"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000


def test_reproduce_and_compare_refuse_a_deleted_run_in_one_line(store: str, capsys: pytest.CaptureFixture) -> None:
    client = MlflowClient(store)
    experiment = client.create_experiment("deleted")
    gone = _fake_run(client, experiment, "gone", "0.1", 0.9, [1.0, 0.5])
    client.delete_run(gone)
    for main, args in ((reproduce.main, [gone]), (compare.main, [gone]), (compare.main, [gone[:12]])):
        with pytest.raises(SystemExit) as exited:
            main([*args, "--uri", store])
        assert exited.value.code == 2
        key = "run id" if main is reproduce.main else "compare"
        assert capsys.readouterr().err.strip() == (f"error: {key}: {gone}: the MLflow run was deleted; restore it first "
                                                   f"(mlflow runs restore --run-id {gone}) or name another run")


@pytest.mark.parametrize("main, missing", [(reproduce.main, "run_id"), (compare.main, "targets")])
def test_reproduce_and_compare_without_arguments_say_what_is_missing_in_one_line(
        main, missing: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {main.__module__.split('.')[-1]}: the following arguments "
                                                   f"are required: {missing}; usage: runner ")


def test_compare_stays_readable_at_a_sweeps_size(tmp_path: Path, store: str, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """40 trials with long names and 12 differing params (before: 1,407-character lines, every run, a legend over
    the chart): the best 20 in lines within the terminal's 100 columns, the params that do not fit in further
    blocks led by the run's #, the rest counted; the chart's legend beside the axes."""
    client = MlflowClient(store)
    experiment = client.create_experiment("big")
    keys = [f"model.config.some_rather_long_key_{i}" for i in range(12)]
    for n in range(40):
        run_id = client.create_run(experiment, run_name=f"trial {n} " + ",".join(f"{k}={n}" for k in keys)).info.run_id
        client.log_batch(run_id, metrics=[Metric("objective", n / 100, 0, 1), Metric("val/loss", 1 - n / 100, 0, 1)],
                         params=[Param(k, str(n * 1000 + i)) for i, k in enumerate(keys)]
                         + [Param("objective.direction", "maximize")])
        client.set_terminated(run_id)
    monkeypatch.setenv("COLUMNS", "100")
    assert compare.main(["big", "--uri", store]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    blocks = [b.splitlines() for b in "\n".join(lines[:-1]).split("\n\n")]
    assert len(blocks) > 1 and all(len(b) == 21 for b in blocks)  # a header and the best 20 in each block
    assert [row.split()[0] for row in blocks[0][1:]] == [str(i) for i in range(1, 21)]
    assert [row.split()[2] for row in blocks[0][1:]] == [f"{n}" for n in range(39, 19, -1)]  # "trial 39 ..." first
    assert sorted(k for b in blocks for k in b[0].split() if k.startswith("model.")) == sorted(keys)
    assert lines[-1] == "... and 20 more runs, not as good (--top 0 shows all)"

    runs = compare.ranked(compare.select_runs(client, ["big"], store))[:20]
    fig = compare.draw({r.info.run_id: [(0, 1.0), (1, 0.5)] for r in runs}, runs, "val/loss")
    fig.canvas.draw()
    legend, axes = fig.axes[0].get_legend().get_window_extent(), fig.axes[0].get_window_extent()
    assert legend.x0 >= axes.x1  # beside the axes, not over the curves
