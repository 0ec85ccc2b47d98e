"""conf/dataset: every option builds a valid DatasetSpec and has a builder."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runner.data import BUILDERS
from runner.registry import CONF_DIR, options
from runner.spec import DatasetSpec, _build

FILES = sorted((CONF_DIR / "dataset").glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_dataset_yaml_is_a_valid_spec_named_after_its_file(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# "), "first line says what the option is"
    spec = _build(DatasetSpec, yaml.safe_load(text), "dataset.")
    assert spec.name == path.stem


def test_every_dataset_option_has_a_builder_and_back() -> None:
    assert options("dataset") == sorted(BUILDERS)
    assert DatasetSpec().name in BUILDERS
