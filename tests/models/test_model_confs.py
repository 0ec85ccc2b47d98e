"""conf/model and conf/dataset: every option names an importable callable whose signature takes every key
of its YAML, none of them a size the data decides; and the spec keeps only the chosen option's keys."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import yaml

from runner.engine.components import build_model
from runner.specs import components
from runner.engine.run_data import build_data
from runner.specs.registry import CONF_DIR
from runner.specs.run import SpecError
from tests.conftest import compose_spec

FILES = sorted((CONF_DIR / "model").glob("*.yaml")) + sorted((CONF_DIR / "dataset").glob("*.yaml"))
LOADER_KEYS = {"batch_size", "num_workers"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_option_names_a_callable_that_takes_its_keys(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# "), "the first line says what the option is"
    data = yaml.safe_load(text)
    group = path.parent.name
    fn = components.load_target(group, data.pop("_target_"))
    params = inspect.signature(fn).parameters
    keys = set(data) - (LOADER_KEYS if group == "dataset" else set())
    assert not keys & set(components.DATA_DECIDED) or group == "dataset"
    open_ended = any(p.kind == p.VAR_KEYWORD for p in params.values())
    assert open_ended or keys <= set(params), keys - set(params)
    resolved = components.resolve(group, fn.__module__ + "." + fn.__name__, {k: data[k] for k in keys})
    assert set(keys) <= set(resolved)


def test_a_run_spec_holds_only_the_chosen_components_keys(tmp_path: Path) -> None:
    spec = compose_spec(["model=resnet18", "dataset=synthetic"], tmp_path)
    flat = spec.flat()
    assert "model.small_stem" in flat and "model.hidden" not in flat and "model.channels" not in flat
    assert "dataset.shape" in flat and [k for k in flat if k.startswith("scheduler.cycle_mult")] == []  # no union
    digits = compose_spec([], tmp_path).flat()
    assert "dataset.shape" not in digits and "model.hidden" in digits


def test_a_users_target_on_the_command_line_is_checked_against_its_signature(tmp_path: Path) -> None:
    spec = compose_spec(["model._target_=tests.models.user_net.WideNet", "+model.width=32"], tmp_path)
    resolved = components.resolve("model", spec.model.target, spec.model.params,
                                  {"model._target_", "model.width"})
    assert resolved == {"width": 32, "depth": 2}  # mlp's keys dropped (not typed), the default filled in
    with pytest.raises(SpecError, match=r"^model.widht: unknown key for tests.models.user_net.WideNet; did you mean width\? "
                                        r"accepted keys: depth, width$"):
        components.resolve("model", spec.model.target, {"widht": 3}, {"model.widht"})
    with pytest.raises(SpecError, match=r"^model.width: 'wide' is not an integer"):
        components.resolve("model", spec.model.target, {"width": "wide"}, {"model.width"})


def test_a_components_plain_errors_are_one_line_under_its_group(tmp_path: Path) -> None:
    """Built-ins and a user's code raise plain ValueError / FileNotFoundError; the component layer names
    the group (and the key, where the message starts with one)."""
    spec = compose_spec(["dataset._target_=tests.models.user_net.rows", f"+dataset.path={tmp_path}/none.csv"], tmp_path)
    spec = components.resolved_spec(spec, {"dataset._target_", "dataset.path"})
    with pytest.raises(SpecError, match=rf"^dataset: rows could not open {tmp_path}/none.csv \(No such file or directory\)$"):
        build_data(spec)
    digits = compose_spec([], tmp_path)
    data = build_data(digits)
    fussy = components.resolved_spec(compose_spec(["model._target_=tests.models.user_net.fussy_net"], tmp_path),
                                     {"model._target_"})
    with pytest.raises(SpecError, match=r"^model: the widths do not add up$"):
        build_model(fussy, data)
    with pytest.raises(SpecError, match=r"^dataset.val_fraction: val_fraction 0.5 \+ test_fraction 0.4999 leave no "
                                        r"training samples out of 1797"):  # data/splits.py's plain ValueError
        build_data(compose_spec(["dataset.val_fraction=0.5", "dataset.test_fraction=0.4999"], tmp_path))


def test_a_size_the_data_must_decide_is_never_advised_as_a_config_key(tmp_path: Path) -> None:
    overrides = ["dataset._target_=tests.user_pkg.tokens.build", "task=language_modeling",
                 "model._target_=tests.models.user_net.needs_padding"]
    spec = components.resolved_spec(compose_spec(overrides, tmp_path), {"dataset._target_", "model._target_"})
    with pytest.raises(SpecError, match=r"^model.pad_token_id: tests.models.user_net.needs_padding needs it and the "
                                        r"dataset \(tests.user_pkg.tokens.build\) does not provide it; choose a dataset "
                                        r"that does$"):  # not "set +model.pad_token_id", which is then refused
        build_model(spec, build_data(spec))
