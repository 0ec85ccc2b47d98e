"""weights.* on a training run (issue 35, item 10): `which` picks among a trained run's weights and `average`
names averaged weights the run must keep, so a training run refuses what eval, predict and export refuse."""
from __future__ import annotations

from pathlib import Path

import pytest

from runner.specs.run import SpecError
from tests.conftest import compose_spec, run_cli


@pytest.mark.parametrize("overrides, message", [
    (["weights.which=best"], "weights.which: best picks a trained run's weights for mode=eval|predict|export, not a "
                             "training run's; drop it (trainer.test_on=best tests the best validation's weights)"),
    (["weights.which=last"], "weights.which: last picks a trained run's weights"),
    (["weights.average=ema"], "weights.average: ema: it names the EMA weights, but the run keeps none "
                              "(trainer.ema.decay is null); set trainer.ema.decay or choose weights.average=none"),
    (["weights.average=swa"], "weights.average: swa: it names the SWA weights, but the run keeps none "
                              "(trainer.swa.start_epoch is null)"),
])
def test_a_training_run_refuses_weights_it_cannot_mean(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError) as err:
        compose_spec(overrides, tmp_path / "run")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_training_run_keeps_the_weights_it_names(tmp_path: Path) -> None:
    spec = compose_spec(["weights.average=ema", "trainer.ema.decay=0.9"], tmp_path / "run")
    assert spec.weights.average == "ema"
    assert compose_spec(["weights.average=none"], tmp_path / "run").weights.which == "tested"


def test_the_cli_refuses_it_in_one_line_before_a_run_directory_exists(tmp_path: Path) -> None:
    out = run_cli(["weights.which=best", "tracking=none", "hydra.run.dir=run"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: weights.which: best picks a trained run's weights for mode=eval|predict|export, not a training run's; "
        "drop it (trainer.test_on=best tests the best validation's weights)"]
    assert not (tmp_path / "run").exists()
