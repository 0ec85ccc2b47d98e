"""The Hydra Sweeper plugin class. Hydra imports this module on every start to find plugins, so the
study loop (optuna, mlflow) is imported only when a sweep actually runs."""
import sys
from typing import Any, List, Optional

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSweeper(Sweeper):
    def __init__(self, sampler: Any, pruner: Any, direction: Any, storage: Optional[str], study_name: Optional[str],
                 n_trials: int, n_jobs: int, max_failure_rate: float, params: Optional[DictConfig],
                 search_space: Optional[DictConfig], custom_search_space: Optional[str],
                 heartbeat_interval: Optional[int], grace_period: Optional[int], max_retry: int) -> None:
        from ._impl import OptunaSweeperImpl, SweeperSettings

        self.sweeper = OptunaSweeperImpl(SweeperSettings(
            sampler=sampler, pruner=pruner, direction=direction, storage=storage, study_name=study_name,
            n_trials=n_trials, n_jobs=n_jobs, max_failure_rate=max_failure_rate, params=params,
            search_space=search_space, custom_search_space=custom_search_space,
            heartbeat_interval=heartbeat_interval, grace_period=grace_period, max_retry=max_retry))

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        """A sweep that cannot start (a bad config, a study that cannot be resumed as asked) exits 2,
        one that stops on failed trials exits 1: one line each, as runner's CLI reports errors."""
        try:
            return self.sweeper.sweep(arguments)
        except (ValueError, RuntimeError) as e:
            # SweepConfigError / SweepFailed, told by attribute rather than by class: Hydra's plugin scan
            # re-executes this package's modules (pkgutil load_module), so a module imported before the scan
            # may raise a class object other than the one an `except SweepConfigError` here would name
            code = getattr(e, "exit_code", None)
            if code is None:
                raise
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(code)
