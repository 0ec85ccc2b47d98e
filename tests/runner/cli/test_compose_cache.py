"""The cache of a single run's composed config (runner/cli/compose_cache.py): any change to what a composition
reads is another key; a config from the cache is the one Hydra composes, its `${now:...}` resolved per run;
a run from the cache logs and writes what a run Hydra composed for does."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.cli import compose_cache
from runner.cli.preflight import _compose
from tests.conftest import REPO


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "runner" / "composed"


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    """A user's search path folder with an option of their own."""
    (tmp_path / "user" / "optimizer").mkdir(parents=True)
    (tmp_path / "user" / "optimizer" / "mine.yaml").write_text("defaults:\n  - adam\n  - _self_\nlr: 0.003\n")
    return tmp_path / "user"


def test_every_input_of_a_composition_is_in_its_key(user_conf: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    searchpath = (f"file://{user_conf}",)
    overrides = ["optimizer=mine"]
    first = compose_cache.key("config", overrides, searchpath)
    assert first is not None and compose_cache.key("config", overrides, searchpath) == first  # nothing changed

    keys = {first}

    def changed() -> str | None:
        k = compose_cache.key("config", overrides, searchpath)
        assert k not in keys
        keys.add(k)
        return k

    (user_conf / "optimizer" / "mine.yaml").write_text("defaults:\n  - adam\n  - _self_\nlr: 0.004\n")  # a value
    changed()
    (user_conf / "optimizer" / "other.yaml").write_text("lr: 0.1\n")  # a new option beside it
    changed()
    overrides = ["optimizer=mine", "seed=1"]  # an override
    changed()
    monkeypatch.setenv("RUNNER_TEST_SOME_SETTING", "1")  # the environment (${oc.env:...}, hydra.job.env_copy)
    changed()
    monkeypatch.chdir(tmp_path)  # the working directory (hydra.runtime.cwd, relative search paths)
    changed()
    searchpath = (f"file://{user_conf}", f"file://{tmp_path}")  # the search path
    changed()


def test_a_search_path_the_key_cannot_read_whole_is_not_cached(user_conf: Path, tmp_path: Path) -> None:
    assert compose_cache.key("config", [], None) is None  # known only once composed (${...})
    assert compose_cache.key("config", [], ("pkg://tests.user_pkg",)) is None  # a package: its code registers configs
    assert compose_cache.key("config", [], (f"file://{tmp_path / 'missing'}",)) is None  # Hydra warns of it each run


def test_a_cached_config_is_the_composed_one_with_its_interpolations_unresolved(cache: Path, user_conf: Path) -> None:
    searchpath = (f"file://{user_conf}",)
    overrides = ["optimizer=mine", f"hydra.searchpath=[file://{user_conf}]"]
    composed, loader = _compose("config", overrides)  # Hydra's, no cache
    stored, _ = _compose("config", overrides, searchpath)  # composed again, and kept
    assert list(cache.glob("*.pickle"))
    cached, lazy = _compose("config", overrides, searchpath)  # from the cache
    assert isinstance(lazy, compose_cache.LazyConfigLoader)
    assert OmegaConf.to_yaml(cached) == OmegaConf.to_yaml(composed) == OmegaConf.to_yaml(stored)
    assert OmegaConf.get_type(cached, "hydra") is OmegaConf.get_type(composed, "hydra")  # Hydra's structured node
    assert cached.optimizer.lr == 0.003
    run_dir = str(OmegaConf.select(cached, "hydra.run.dir"))
    time.sleep(0.01)
    again, _ = _compose("config", overrides, searchpath)
    assert str(OmegaConf.select(again, "hydra.run.dir")) != run_dir  # ${now:...} resolves in each run
    # the loader it gives is Hydra's, once used: a job's own composition finds the user's options
    assert "mine" in lazy.get_group_options("optimizer", config_name="config", overrides=overrides[1:])
    assert lazy.get_search_path().get_path()[1].path == loader.get_search_path().get_path()[1].path


def test_a_cache_that_cannot_be_written_is_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "not_a_folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not_a_folder"))
    for _ in range(2):
        cfg, loader = _compose("config", ["seed=5"], ())
        assert cfg.seed == 5 and not isinstance(loader, compose_cache.LazyConfigLoader)  # composed each time


def test_the_most_recently_used_configs_are_kept(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compose_cache, "_KEEP", 2)
    for seed in (1, 2, 3):
        _compose("config", [f"seed={seed}"], ())
        time.sleep(0.01)  # distinct modification times
    assert len(list(cache.glob("*.pickle"))) == 2
    assert isinstance(_compose("config", ["seed=3"], ())[1], compose_cache.LazyConfigLoader)  # kept
    assert not isinstance(_compose("config", ["seed=1"], ())[1], compose_cache.LazyConfigLoader)  # the oldest: gone


def _logged(uri: str) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    record = {}
    for run in client.search_runs([e.experiment_id for e in client.search_experiments()]):
        history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                   for key in run.data.metrics if not key.startswith(("throughput/", "time/", "system/"))}
        params = {k: v for k, v in run.data.params.items() if k != "run_dir"}
        record[run.info.start_time] = (run.info.status, params, history)
    return dict(sorted(record.items()))


def _files(run_dir: Path) -> dict[str, str]:
    """The run's config files (result.yaml holds its timings: its metrics are compared in MLflow)."""
    texts = {p.relative_to(run_dir).as_posix(): p.read_text() for p in sorted(run_dir.rglob("*.yaml"))
             if p.name != "result.yaml"}
    return {name: text.replace(str(run_dir), "<run>") for name, text in texts.items()}


def test_a_run_from_the_cache_logs_and_writes_what_a_composed_run_does(tmp_path: Path, store: str) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "XDG_CACHE_HOME": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "runner", "trainer.max_steps=3", "trainer.eval_every_n_steps=3",
               "trainer.log_every_n_steps=1",
               f"tracking.uri={store}", f"tracking.artifact_root={tmp_path / 'artifacts'}"]

    def run() -> None:
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]

    run()  # a miss: Hydra composes, and the config is kept
    [entry] = (cache / "runner" / "composed").glob("*.pickle")
    os.utime(entry, (0, 0))
    run()
    assert entry.stat().st_mtime > 0  # the second run took its config from the cache
    first, second = sorted((tmp_path / "outputs" / "runs").glob("*/*"))
    assert first.name != second.name  # each run its own directory (${now:...})
    assert set(_files(first)) >= {"spec.yaml", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"}
    assert _files(first) == _files(second)
    runs = list(_logged(store).values())
    assert len(runs) == 2 and runs[0] == runs[1]
    assert len(runs[0][2]["train/loss"]) == 3 and runs[0][2]["val/acc"]
