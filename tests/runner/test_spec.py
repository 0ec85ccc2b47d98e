from pathlib import Path

import pytest

from runner.spec import RunSpec, SpecError
from tests.conftest import compose_spec


def test_default_spec_composes_and_round_trips_through_yaml(tmp_path: Path) -> None:
    spec = compose_spec([], tmp_path / "run")
    assert spec.dataset.name == "digits" and spec.accumulation.steps == 1
    again = RunSpec.from_yaml(spec.to_yaml())
    assert again == spec


def test_accum_shorthand_sets_accumulation_steps(tmp_path: Path) -> None:
    spec = compose_spec(["+accum=4"], tmp_path / "run")
    assert spec.accumulation.steps == 4
    assert "accum" not in spec.to_dict()  # spec.yaml holds only the resolved key


def test_accum_shorthand_agreeing_with_explicit_key_is_fine(tmp_path: Path) -> None:
    assert compose_spec(["+accum=2", "accumulation.steps=2"], tmp_path / "run").accumulation.steps == 2


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.lr=abc"], "optimizer.lr: 'abc' is not a number; allowed: a value > 0"),
    (["optimizer.lr=-1"], "optimizer.lr: -1.0 is out of range; allowed: a value > 0"),
    (["+accum=0"], "accumulation.steps: 0 is out of range; allowed: a value > 0"),
    (["dataset.batch_size=0"], "dataset.batch_size: 0 is out of range; allowed: a value > 0"),
    (["+accum=4", "accumulation.steps=2"], "accum: +accum=4 conflicts with accumulation.steps=2; set only one"),
    (["trainer.device=tpu"], "trainer.device: 'tpu' is not allowed; choose one of auto, cpu, cuda"),
    (["+optimizer.lrr=0.1"], "optimizer.lrr: unknown key; allowed keys under optimizer:"),
    (["trainer.max_steps=1.5"], "trainer.max_steps: 1.5 is not an integer"),
    (["trainer.clip_grad_norm=1", "trainer.clip_grad_value=1"], "set either clip_grad_norm or clip_grad_value"),
])
def test_bad_values_name_the_key_the_value_and_what_is_allowed(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError) as err:
        compose_spec(overrides, tmp_path / "run")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_flat_params_cover_every_leaf(tmp_path: Path) -> None:
    flat = compose_spec(["optimizer=adamw"], tmp_path / "run").flat()
    assert flat["optimizer.name"] == "adamw"
    assert flat["trainer.early_stopping.patience"] == 5
    assert "dataset.batch_size" in flat
