"""The Hydra Sweeper plugin class: composes the base config once, then runner/search/pbt/sweep.py runs the
population. runner is imported only when a sweep runs (Hydra imports this module on every start)."""
import sys
from typing import Any, List

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class PbtSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def sweep(self, arguments: List[str]) -> Any:
        from runner.search.pbt.sweep import run_sweep
        from runner.spec.run import SpecError

        settings = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in self.settings.items()}
        try:
            return run_sweep(settings, arguments, self.config, self.hydra_context.config_loader)
        except SpecError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
