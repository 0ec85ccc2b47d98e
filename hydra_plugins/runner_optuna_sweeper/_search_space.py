"""Hydra's override grammar -> Optuna distributions, as hydra-optuna-sweeper reads it.

    choice(a, b, c)                 CategoricalDistribution
    range(start, stop, step)        IntDistribution, or FloatDistribution with a step when any bound
                                    or the step is a float; the stop is excluded, as in Hydra
    shuffle(range(...))             CategoricalDistribution of the range's values
    interval(low, high)             FloatDistribution;   int(interval(...)): IntDistribution
    tag(log, interval(...))         the same on a log scale
    anything else                   a fixed value passed to every trial unchanged
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)


def distribution_from_override(override: Override) -> BaseDistribution | str:
    """The distribution an override sweeps over, or its value (as override text) when it is fixed."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    value = override.value()
    if isinstance(value, ChoiceSweep) or (isinstance(value, RangeSweep) and value.shuffle):
        return CategoricalDistribution(_encoded_values(override))
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())  # Hydra's own expansion: the stop is excluded
        if not values:
            raise ValueError(f"{override.input_line}: the range is empty")
        low, high, step = min(values), max(values), abs(value.step)
        if any(isinstance(v, float) for v in (value.start, value.stop, value.step)):
            return FloatDistribution(float(low), float(high), step=float(step))
        return IntDistribution(int(low), int(high), step=int(step))
    if isinstance(value, IntervalSweep):
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise ValueError(f"{override.input_line}: this kind of sweep is not supported by the Optuna sweeper")


def _encoded_values(override: Override) -> list[Any]:
    choices = []
    for x in override.sweep_iterator(transformer=Transformer.encode):
        if not isinstance(x, (str, int, float, bool, type(None))):
            raise ValueError(f"{override.input_line}: a choice takes str, int, float, bool or null values, got {x!r}")
        choices.append(x)
    return choices


def parse_params(arguments: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str]]:
    """Split overrides into the search space and the fixed values; a later override of the same
    key wins, so command-line arguments (parsed after hydra.sweeper.params) replace the config's."""
    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        value = distribution_from_override(override)
        space.pop(key, None)
        fixed.pop(key, None)
        if isinstance(value, BaseDistribution):
            space[key] = value
        else:
            fixed[key] = value
    return space, fixed


def distribution_from_config(config: Mapping[str, Any]) -> BaseDistribution:
    """hydra-optuna-sweeper 1.1's `search_space` entries: {type: int|float|categorical, low, high, log, step, choices}."""
    kind = str(config["type"]).split(".")[-1]
    if kind == "categorical":
        return CategoricalDistribution(list(config["choices"]))
    low, high, log, step = config.get("low"), config.get("high"), bool(config.get("log", False)), config.get("step")
    if kind == "int":
        return IntDistribution(int(low), int(high), log=log, step=int(step) if step is not None and not log else 1)
    if kind == "float":
        return FloatDistribution(float(low), float(high), log=log, step=None if log or step is None else float(step))
    raise ValueError(f"search_space: unknown distribution type {config['type']!r}; use int, float or categorical")


def grid_values(name: str, distribution: BaseDistribution) -> list[Any]:
    """Every value of a discrete distribution, for the grid sampler (bounds included)."""
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, (IntDistribution, FloatDistribution)) and distribution.step is not None and not distribution.log:
        n = int(round((distribution.high - distribution.low) / distribution.step)) + 1
        return [distribution.low + i * distribution.step for i in range(n)]
    raise ValueError(f"hydra.sweeper.params.{name}: the grid sampler needs discrete values "
                     f"(choice or range), not {type(distribution).__name__}")


def suggest(trial: Any, name: str, d: BaseDistribution) -> None:
    """Sample (or, for a retried trial, re-read) one parameter through Optuna's public API."""
    if isinstance(d, CategoricalDistribution):
        trial.suggest_categorical(name, d.choices)
    elif isinstance(d, IntDistribution):
        trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
    else:
        trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)


def describe(distribution: BaseDistribution) -> str:
    """A short text for MLflow params and logs: 'log-uniform [0.0001, 0.1]', 'choice(sgd, adam)'."""
    if isinstance(distribution, CategoricalDistribution):
        return "choice(" + ", ".join(map(str, distribution.choices)) + ")"
    kind = "int" if isinstance(distribution, IntDistribution) else "float"
    scale = "log " if distribution.log else ""
    show_step = distribution.step is not None and not (kind == "int" and distribution.step == 1)
    step = f" step {distribution.step:g}" if show_step else ""
    return f"{scale}{kind} [{distribution.low:g}, {distribution.high:g}]{step}"
