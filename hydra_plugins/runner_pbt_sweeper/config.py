"""`hydra/sweeper=pbt`: the config schema (runner/search/pbt/population.py's Settings, plus the search space).
Imported by Hydra's plugin scan on every start: it imports neither torch nor runner."""
from dataclasses import dataclass, field
from typing import Any, Dict, List

from hydra.core.config_store import ConfigStore


@dataclass
class PbtSweeperConf:
    _target_: str = "hydra_plugins.runner_pbt_sweeper.pbt_sweeper.PbtSweeper"
    population: int = 4                 # members trained side by side
    ready: int = 50                     # optimizer steps per round: members are compared at each boundary
    quantile: float = 0.25              # the bottom quantile copies a member of the top quantile
    explore: str = "pbt"                # pbt: perturb x0.8/x1.2 or resample; pb2: a GP bandit over recent rounds
    perturb: List[float] = field(default_factory=lambda: [0.8, 1.2])
    resample_probability: float = 0.25
    n_jobs: int = 1                     # members trained at once: each in its own process when > 1 (basic
                                        # launcher), or handed together to the hydra/launcher chosen
    seed: int = 0                       # the first hyperparameters, the exploit pairs and the explore draws
    pb2_kappa: float = 2.0              # pb2: the upper confidence bound's weight on the GP's uncertainty
    params: Dict[str, Any] = field(default_factory=dict)  # key: interval(lo, hi) | tag(log, interval(lo, hi)) | choice(numbers)


ConfigStore.instance().store(group="hydra/sweeper", name="pbt", node=PbtSweeperConf, provider="runner_pbt_sweeper")
