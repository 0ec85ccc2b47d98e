"""conf/model: every option builds a valid ModelSpec and has a builder."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runner.models import BUILDERS
from runner.registry import CONF_DIR, options
from runner.spec import ModelSpec, _build

FILES = sorted((CONF_DIR / "model").glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_model_yaml_is_a_valid_spec_named_after_its_file(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# "), "first line says what the option is"
    spec = _build(ModelSpec, yaml.safe_load(text), "model.")
    assert spec.name == path.stem


def test_every_model_option_has_a_builder_and_back() -> None:
    assert options("model") == sorted(BUILDERS)
    assert ModelSpec().name in BUILDERS
