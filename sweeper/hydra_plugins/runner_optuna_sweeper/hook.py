"""How an app adds its own extras to the sweeps of its task (runner: the MLflow parent run, trial
reporting), without the sweeper importing the app.

The app declares its hook on its task function, under `@hydra.main`:

    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    @sweep_hook("my_app.sweeps.MyHook")
    def main(cfg): ...

The sweeper builds the hook once per sweep from the composed config and calls it; an app without
one gets the plain sweep (no overrides added to its jobs, nothing tracked), whatever its config's
keys are named. A hook's method may raise SweepConfigError to stop the sweep with one line, exit 2.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from omegaconf import DictConfig

HOOK_ATTR = "optuna_sweep_hook"
F = TypeVar("F", bound=Callable[..., Any])


class SweepConfigError(ValueError):
    """A sweep that cannot start as configured: one line naming the key, exit code 2."""

    exit_code = 2  # read by the sweeper by attribute: see OptunaSweeper.sweep


def sweep_hook(dotpath: str) -> Callable[[F], F]:
    """Declare the SweepHook subclass (`package.module.Class`, imported only when a sweep runs)."""
    def mark(task_function: F) -> F:
        setattr(task_function, HOOK_ATTR, dotpath)
        return task_function
    return mark


class SweepHook:
    """Every method has a do-nothing default; `config` is the composed config of the sweep."""

    def __init__(self, config: DictConfig) -> None:
        self.config = config

    def direction(self) -> Any:
        """The objective's direction(s) when hydra.sweeper.direction is null (None: minimize)."""
        return None

    def preload(self) -> list[str]:
        """Modules every job imports, for the trial fork server to import once."""
        return []

    def trial_overrides(self, storage_url: str, study_name: str, number: int) -> list[str]:
        """Overrides added to a trial's job, e.g. to let it report to its trial."""
        return []

    def sweep_started(self, study: Any, description: dict[str, Any]) -> None:
        """The study is open and about to run (description: study_name, storage, sampler, pruner,
        direction, n_jobs, n_trials, sweep_dir, search_space.<key>, fixed.<key>)."""

    def trial_done(self, study: Any, trial: Any, killed: bool) -> None:
        """A trial ended (trial: its FrozenTrial; killed: its process died). Must not raise."""

    def sweep_finished(self, study: Any, status: str, results: Optional[Path]) -> None:
        """The sweep ended FINISHED, FAILED or KILLED; results: optimization_results.yaml. Must not raise."""


def load_hook(task_function: Any, config: DictConfig) -> SweepHook:
    from hydra.utils import get_class

    dotpath = getattr(task_function, HOOK_ATTR, None)
    return get_class(dotpath)(config) if dotpath else SweepHook(config)
