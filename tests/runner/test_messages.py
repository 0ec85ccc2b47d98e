"""Messages of issue 35's item 13 that concern compositions and the finders: each says what happened, under the
key that decides it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import compose_spec, run_cli


def _report(tmp_path: Path, last_lr: float) -> str:
    from runner.tune.lr_find import LrCurve, LrSuggestion, describe

    spec = compose_spec(["tune=lr_find", "tune.max_lr=10"], tmp_path / "run")
    curve = LrCurve(lrs=[1e-3, 1e-2, 1e-1, last_lr], losses=[2.0, 1.5, 1.0, 0.9], smoothed=[2.0, 1.5, 1.0, 0.9])
    suggestion = LrSuggestion(lr=0.01, steepest_lr=0.01, slope=-0.2, lowest_lr=last_lr, lowest_loss=0.9,
                              diverged_at=None, reason="steepest descent")
    return "\n".join(describe(spec, curve, suggestion))


def test_lr_find_names_tune_max_lr_only_where_the_sweep_reached_it(tmp_path: Path) -> None:
    """A sweep that stopped at lr 2.7 of max_lr 10 said "no divergence up to tune.max_lr=2.7"."""
    short = _report(tmp_path, 2.7)
    assert "no divergence up to lr 2.7, the last measured (tune.max_lr=10 was not reached)" in short
    assert "tune.max_lr=2.7" not in short
    assert "no divergence up to tune.max_lr=10" in _report(tmp_path, 10.0)


@pytest.mark.parametrize("typed", ["logger=wandb", "logger.name=wandb"])
def test_a_loggers_key_is_told_that_tracking_is_the_logger_group(tmp_path: Path, typed: str) -> None:
    proc = run_cli([typed], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: logger: unknown key; Lightning's logger is runner's tracking group: "
                                   "tracking=mlflow or none (tracking.uri, tracking.experiment)")

