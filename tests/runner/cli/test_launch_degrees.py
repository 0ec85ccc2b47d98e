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

