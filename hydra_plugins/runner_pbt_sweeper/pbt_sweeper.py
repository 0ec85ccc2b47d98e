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
        from hydra.core.plugins import Plugins

        from runner.search.pbt.launcher import member_task

        self.config, self.hydra_context = config, hydra_context
        # the launcher the user chose runs members' rounds (member_task), not the app's task function
        self.launcher = Plugins.instance().instantiate_launcher(config=config, hydra_context=hydra_context,
                                                                task_function=member_task)

    def sweep(self, arguments: List[str]) -> Any:
        from runner.search.pbt.launcher import MemberFailed
        from runner.search.pbt.sweep import run_sweep
        from runner.specs.run import SpecError

        settings = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in self.settings.items()}
        try:
            return run_sweep(settings, arguments, self.config, self.hydra_context.config_loader, launcher=self.launcher)
        except SpecError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        except MemberFailed as e:  # a member's job failed under the user's launcher: the line says where its log is
            print(f"runner: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
