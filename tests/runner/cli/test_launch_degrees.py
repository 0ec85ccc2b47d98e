"""How many workers the launcher starts (runner/cli/launch.py): nproc_per_node under ddp/fsdp/hsdp, and under
single one per model-parallel rank (tp x pp x cp), so `python -m runner parallelism.pp=4 ...` runs one model
on four processes."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import compose_spec


class _Started(BaseException):
    """Raised by the stand-in agent: the launch config was built; no worker runs."""


@pytest.mark.parametrize("overrides, nproc", [
    (["parallelism.tp=2"], 2),
    (["parallelism.pp=4", "parallelism.pp_schedule=interleaved_1f1b", "parallelism.pp_microbatches=8"], 4),
    (["parallelism.tp=2", "parallelism.pp=2"], 4),
    (["parallelism=fsdp", "parallelism.nproc_per_node=8", "parallelism.tp=2"], 8),
    (["parallelism=hsdp", "parallelism.dp_replicate=2"], 4),
])
def test_the_agent_starts_the_processes_the_degrees_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          overrides: list[str], nproc: int) -> None:
    import torch.distributed.launcher.api as agent

    from runner.cli import launch

    configs = []

    def elastic_launch(config, entrypoint):
        configs.append(config)
        raise _Started

    monkeypatch.setattr(agent, "elastic_launch", elastic_launch)
    monkeypatch.setattr(launch, "check_parallel", lambda spec: None)  # the model's own checks: other tests
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = compose_spec(overrides, tmp_path / "run")
    (tmp_path / "run").mkdir()
    with pytest.raises(_Started):
        launch.launch_workers(spec)
    assert configs[0].nproc_per_node == nproc and configs[0].max_nodes == 1



def test_eval_and_predict_refuse_a_model_parallel_degree_under_single(tmp_path: Path) -> None:
    """They run in one process on full weights: tp=2 would otherwise start two processes."""
    from runner.specs.run import SpecError

    with pytest.raises(SpecError) as e:  # the composition table's cell, while the spec is built
        compose_spec(["mode=eval", f"trainer.resume={tmp_path}", "parallelism.tp=2"], tmp_path / "run")
    assert str(e.value) == ("mode=eval with parallelism.tp=2: runs in one process (it reads weights saved at any mesh); "
                            "drop the parallelism keys")


@pytest.mark.slow  # two real processes through the CLI; the launch config itself is the unit test above
def test_a_model_parallel_degree_alone_runs_one_replica_on_its_processes(tmp_path: Path) -> None:
    import sqlite3

    from tests.conftest import run_cli

    db = tmp_path / "mlflow.db"
    proc = run_cli(["parallelism.tp=2", "model=gpt", "dataset=synthetic_tokens", "task=language_modeling",
                    "dataset.vocab_size=64", "dataset.block_size=16", "dataset.size=40", "dataset.batch_size=4",
                    "trainer.max_steps=2", "trainer.memory_estimate=false", "trainer.progress_bar=off",
                    f"hydra.run.dir={tmp_path / 'run'}", f"tracking.uri=sqlite:///{db}",
                    f"tracking.artifact_root={tmp_path / 'artifacts'}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting 2 workers on this node (1 node), parallelism=single: tp=2" in proc.stdout + proc.stderr
    with sqlite3.connect(db) as con:
        tags = dict(con.execute("select key, value from tags"))
    # two processes, one data-parallel replica: the global batch is the per-rank batch
    assert (tags["world_size"], tags["dp_degree"], tags["global_batch_size"]) == ("2", "1", "4")


@pytest.mark.parametrize("overrides, said", [
    (["parallelism=hsdp", "parallelism.nproc_per_node=4", "parallelism.dp_replicate=2"],
     "starting 4 workers on this node (1 node), parallelism=hsdp: dp_replicate=2 x dp_shard=2"),
    (["parallelism.tp=2", "model=gpt", "dataset=synthetic_tokens", "task=language_modeling"],
     "starting 2 workers on this node (1 node), parallelism=single: tp=2"),
])
def test_the_launcher_says_the_mesh_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture, overrides: list[str], said: str) -> None:
    """hsdp's resolved degrees were logged nowhere, and tp=2 said "starting 2 single workers"."""
    import logging

    import torch.distributed.launcher.api as agent

    from runner.cli import launch

    def elastic_launch(config, entrypoint):
        raise _Started

    monkeypatch.setattr(agent, "elastic_launch", elastic_launch)
    monkeypatch.setattr(launch, "check_parallel", lambda spec: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = compose_spec(overrides, tmp_path / "run")
    (tmp_path / "run").mkdir()
    with caplog.at_level(logging.INFO, logger="runner.cli.launch"), pytest.raises(_Started):
        launch.launch_workers(spec)
    assert said in caplog.text
