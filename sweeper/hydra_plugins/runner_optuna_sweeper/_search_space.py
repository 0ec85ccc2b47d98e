"""Hydra's override grammar -> Optuna distributions, as hydra-optuna-sweeper reads it.

    choice(a, b, c)                 CategoricalDistribution
    range(start, stop, step)        IntDistribution, or FloatDistribution with a step when any bound
                                    or the step is a float; the stop is INCLUDED when the steps reach
                                    it (as hydra-optuna-sweeper reads it; Hydra's basic sweeper leaves
                                    it out): range(1, 3) is {1, 2, 3}
    shuffle(range(...))             CategoricalDistribution of the same values as range(...)
    interval(low, high)             FloatDistribution;   int(interval(...)): IntDistribution
    tag(log, interval(...))         the same on a log scale (low > 0); any other tag is refused
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

from .hook import SweepConfigError


def distribution_from_override(override: Override, key: str = "") -> BaseDistribution | str:
    """The distribution an override sweeps over, or its value (as override text) when it is fixed.
    A sweep the sampler cannot take as written is a SweepConfigError naming `key`."""
    key = key or override.get_key_element()
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    value = override.value()
    text = (override.input_line or "").partition("=")[2].strip()
    tags = set(getattr(value, "tags", None) or ())
    if tags - {"log"}:
        raise SweepConfigError(f"{key}: {text}: unknown tag {sorted(tags - {'log'})[0]!r}; allowed: log, as in "
                               "tag(log, interval(low, high))")
    if tags and not isinstance(value, IntervalSweep):
        raise SweepConfigError(f"{key}: {text}: tag(log, ...) applies to an interval only; allowed: "
                               "tag(log, interval(low, high))")
    if isinstance(value, ChoiceSweep):
        return CategoricalDistribution(_encoded_values(override))
    if isinstance(value, RangeSweep):
        low, high, step = _inclusive_range(key, text, value)
        if value.shuffle:  # a shuffled order means nothing to a sampler: a choice over the same values
            return CategoricalDistribution([low + i * step for i in range(int(round((high - low) / step)) + 1)])
        if isinstance(step, float):
            return FloatDistribution(low, high, step=step)
        return IntDistribution(low, high, step=step)
    if isinstance(value, IntervalSweep):
        log = "log" in tags
        if value.start > value.end:
            raise SweepConfigError(f"{key}: {text}: its low {value.start} is above its high {value.end}; "
                                   "allowed: interval(low, high) with low <= high")
        if log and value.start <= 0:
            raise SweepConfigError(f"{key}: {text}: a log scale needs low > 0, got {value.start}")
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise SweepConfigError(f"{key}: {text}: this kind of sweep is not supported by the Optuna sweeper; allowed: "
                           "choice, range, interval, tag(log, interval)")


def _inclusive_range(key: str, text: str, r: RangeSweep) -> tuple[Any, Any, Any]:
    """(low, high, step) of the values start, start + step, ... up to and including stop. Hydra's own
    expansion stops before `stop`; hydra-optuna-sweeper hands start and stop to Optuna as the bounds,
    so the stop is a possible value there, and users' configs rely on it."""
    start, stop, step = r.start, r.stop, r.step
    if step == 0:
        raise SweepConfigError(f"{key}: {text}: the step of a range cannot be 0")
    if (stop - start) / step < 0:
        raise SweepConfigError(f"{key}: {text} is empty (a step of {step} never goes from {start} to {stop}); allowed: "
                               f"range(start, stop) with start <= stop, or a negative step to count down")
    is_float = any(isinstance(v, float) for v in (start, stop, step))
    n = int((stop - start) / step + 1e-9)  # whole steps that fit; the tolerance keeps 5.5 in range(-5.5, 5.5, 0.5)
    last = start + n * step
    low, high = min(start, last), max(start, last)
    if is_float:  # rounded: -5.5 + 22 * 0.5 must read 5.5, not 5.500000000000001
        return round(float(low), 12), round(float(high), 12), float(abs(step))
    return int(low), int(high), int(abs(step))


def _encoded_values(override: Override) -> list[Any]:
    choices = []
    for x in override.sweep_iterator(transformer=Transformer.encode):
        if not isinstance(x, (str, int, float, bool, type(None))):
            raise SweepConfigError(f"{override.get_key_element()}: a choice takes str, int, float, bool or null values, got {x!r}")
        choices.append(x)
    return choices


def parse_params(arguments: list[str], prefixes: list[str] | None = None) -> tuple[dict[str, BaseDistribution], dict[str, str], list[str]]:
    """Split overrides into the search space, the fixed values and the deletions (`~key`, `~key=value`,
    handed to every job as typed, as hydra-optuna-sweeper does); a later override of the same key wins,
    so command-line arguments (parsed after hydra.sweeper.params) replace the config's.
    prefixes[i]: where argument i comes from, for errors ('hydra.sweeper.params.' for the config's)."""
    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    deletions: list[str] = []
    for i, override in enumerate(OverridesParser.create().parse_overrides(arguments)):
        if override.is_delete():
            deletions.append(arguments[i].strip())
            continue
        key = override.get_key_element()
        value = distribution_from_override(override, (prefixes[i] if prefixes else "") + key)
        space.pop(key, None)
        fixed.pop(key, None)
        if isinstance(value, BaseDistribution):
            space[key] = value
        else:
            fixed[key] = value
    return space, fixed, deletions


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
    raise SweepConfigError(f"hydra.sweeper.search_space: unknown distribution type {config['type']!r}; use int, float or categorical")


def grid_values(name: str, distribution: BaseDistribution) -> list[Any]:
    """Every value of a discrete distribution, for the grid sampler (bounds included)."""
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, (IntDistribution, FloatDistribution)) and distribution.step is not None and not distribution.log:
        n = int(round((distribution.high - distribution.low) / distribution.step)) + 1
        values = [distribution.low + i * distribution.step for i in range(n)]
        return [round(v, 12) for v in values] if isinstance(distribution, FloatDistribution) else values
    raise SweepConfigError(f"hydra.sweeper.params.{name}: the grid sampler needs discrete values "
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
