"""The sweeper's own settings, checked before anything is made (no study, no parent run): each
mistake is one line naming the key, exit code 2."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

from .hook import SweepConfigError

DIRECTIONS = ("minimize", "maximize")


def check_settings(s: Any, directions: list[str]) -> None:
    _check_int("hydra.sweeper.n_trials", s.n_trials, 1, "an integer >= 1 (trials of the study in total)")
    if s.n_jobs != -1:
        _check_int("hydra.sweeper.n_jobs", s.n_jobs, 1, "an integer >= 1, or -1 for one per GPU (else per CPU core)")
    rate = s.max_failure_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise SweepConfigError(f"hydra.sweeper.max_failure_rate: {rate!r} is out of range; allowed: a share of n_trials "
                               "from 0.0 (stop at the first failure) to 1.0 (never stop on failures)")
    for d in directions:
        if d not in DIRECTIONS:
            raise SweepConfigError(f"hydra.sweeper.direction: {d!r} is not a direction; allowed: minimize, maximize, or a "
                                   "list of them for several objectives")
    if s.heartbeat_interval is not None:  # 0 reads as "beat all the time", not "off": null says off
        _check_int("hydra.sweeper.heartbeat_interval", s.heartbeat_interval, 1, "an integer >= 1 (seconds), or null: off")
    if s.study_name is not None and (not isinstance(s.study_name, str) or not s.study_name.strip()):
        raise SweepConfigError(f"hydra.sweeper.study_name: {s.study_name!r} is not a name; allowed: a non-empty name, "
                               "or null for a new study named by Optuna")
    if s.grace_period is not None:
        _check_int("hydra.sweeper.grace_period", s.grace_period, 1, "an integer >= 1 (seconds), or null")
    _check_int("hydra.sweeper.max_retry", s.max_retry, 0, "an integer >= 0")


def custom_search_space(dotpath: Optional[str]) -> Optional[Callable[..., None]]:
    """hydra.sweeper.custom_search_space's function, imported now."""
    if not dotpath:
        return None
    try:
        fn = _locate(dotpath)
    except (ImportError, AttributeError) as e:
        raise SweepConfigError(f"hydra.sweeper.custom_search_space: cannot import {dotpath!r} ({e}); allowed: the "
                               "dotpath of a function fn(cfg, trial), e.g. my_pkg.search.space") from None
    if not callable(fn):
        raise SweepConfigError(f"hydra.sweeper.custom_search_space: {dotpath!r} is not a function; allowed: the "
                               "dotpath of a function fn(cfg, trial)")
    return fn


def _locate(dotpath: str) -> Any:
    """The object at package.module.name (Hydra's get_method would also log its error at length)."""
    parts = dotpath.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue  # a shorter prefix may be the module
            raise
        for name in parts[i:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(f"No module named {parts[0]!r}")


def _check_int(key: str, value: Any, low: int, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SweepConfigError(f"{key}: {value!r} is out of range; allowed: {allowed}")
