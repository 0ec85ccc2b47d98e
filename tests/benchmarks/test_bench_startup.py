"""benchmarks/bench_startup.py measures what it says (figures are never asserted: they depend on the
machine), and benchmarks/lightning_default.py, Lightning's run of the same work, runs where lightning is
installed (it is not one of runner's dependencies)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import bench_startup


def test_the_first_step_mark_comes_from_a_real_run_and_a_typo_exits_2(tmp_path: Path) -> None:
    first = bench_startup.timed(bench_startup.runner_command(("tracking=none", "trainer.max_steps=2"), True),
                                tmp_path, True)
    assert 0 < first.cpu and 0 < first.wall
    typo = bench_startup.timed(bench_startup.runner_command(("optimzer=adamw",), False), tmp_path, False)
    assert typo.code == 2 and typo.cpu > 0


def test_lightnings_run_of_the_same_work_trains_and_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    from benchmarks import lightning_default

    monkeypatch.chdir(tmp_path)
    metrics = lightning_default.main(["--epochs", "1", "--root", str(tmp_path / "runs")])
    assert set(metrics) == {"test/loss", "test/acc", "test/top5"} and metrics["test/acc"] > 0.5
