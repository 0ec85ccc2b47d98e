"""`hydra/sweeper=runner_optuna` (also `optuna` where hydra-optuna-sweeper is not installed): the
config schema. It accepts hydra-optuna-sweeper's keys (sampler, direction, storage, study_name,
n_trials, n_jobs, params, search_space, custom_search_space, max_failure_rate) so existing configs
carry over, and adds a pruner, heartbeats and retries.

Sampler fields left null take the installed Optuna's default (Optuna deprecates some of the keys
hydra-optuna-sweeper wrote out, e.g. TPE's consider_prior; set them only to change them).
This module is imported by Hydra's plugin scan on every start: it imports neither optuna nor mlflow.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class SamplerConfig:
    _target_: str = MISSING
    # the sweep process that creates the study uses this seed; one that resumes or joins a study adds a
    # random per-process number to it, so processes sharing a study propose different trials
    seed: Optional[int] = None


@dataclass
class TPESamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.TPESampler"
    consider_prior: Optional[bool] = None
    prior_weight: Optional[float] = None
    consider_magic_clip: Optional[bool] = None
    consider_endpoints: Optional[bool] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: Optional[bool] = None
    group: Optional[bool] = None
    warn_independent_sampling: Optional[bool] = None
    constant_liar: Optional[bool] = None  # keeps parallel slots from proposing the same point


@dataclass
class RandomSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.RandomSampler"


@dataclass
class CmaEsSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.CmaEsSampler"
    x0: Optional[Dict[str, Any]] = None
    sigma0: Optional[float] = None
    n_startup_trials: Optional[int] = None
    independent_sampler: Optional[Any] = None
    warn_independent_sampling: Optional[bool] = None
    consider_pruned_trials: Optional[bool] = None
    restart_strategy: Optional[str] = None
    popsize: Optional[int] = None
    inc_popsize: Optional[int] = None
    use_separable_cma: Optional[bool] = None
    with_margin: Optional[bool] = None
    lr_adapt: Optional[bool] = None
    source_trials: Optional[Any] = None


@dataclass
class NSGAIISamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.NSGAIISampler"
    population_size: int = 50
    mutation_prob: Optional[float] = None
    crossover_prob: Optional[float] = None
    swapping_prob: Optional[float] = None
    constraints_func: Optional[Any] = None


MOTPE_REMOVED = ("the 'motpe' sampler was removed in Optuna 4.0; use hydra/sweeper/sampler=tpe (TPESampler handles "
                 "several objectives) or hydra/sweeper/sampler=nsgaii")


def raise_motpe_removed(*args: Any, **kwargs: Any) -> None:
    """What `motpe` instantiates to, as in hydra-optuna-sweeper: the sweeper says it in one line before."""
    raise ValueError(MOTPE_REMOVED[0].upper() + MOTPE_REMOVED[1:])


@dataclass
class MOTPESamplerConfig(SamplerConfig):
    """hydra-optuna-sweeper's `motpe`: Optuna 4 removed MOTPESampler; choosing it stops the sweep with
    one line saying what to use instead (its old keys are accepted so that line is what users see)."""

    _target_: str = "hydra_plugins.runner_optuna_sweeper.config.raise_motpe_removed"
    consider_prior: Optional[bool] = None
    prior_weight: Optional[float] = None
    consider_magic_clip: Optional[bool] = None
    consider_endpoints: Optional[bool] = None
    n_startup_trials: Optional[int] = None
    n_ehvi_candidates: Optional[int] = None


@dataclass
class GridSamplerConfig(SamplerConfig):
    """The grid is built from `params` (choice and range only); n_trials is capped at its size."""

    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True


@dataclass
class GPSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.GPSampler"
    n_startup_trials: Optional[int] = None
    deterministic_objective: Optional[bool] = None
    independent_sampler: Optional[Any] = None
    warn_independent_sampling: Optional[bool] = None


@dataclass
class QMCSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.QMCSampler"
    qmc_type: str = "sobol"
    scramble: Optional[bool] = None
    independent_sampler: Optional[Any] = None
    warn_asynchronous_seeding: Optional[bool] = None
    warn_independent_sampling: Optional[bool] = None


@dataclass
class PrunerConfig:
    """Pruners judge the objective each job reports after every evaluation (step = evaluations so
    far, i.e. epochs by default). Jobs build the pruner from this config, read from the study."""

    _target_: str = MISSING


@dataclass
class NopPrunerConfig(PrunerConfig):
    _target_: str = "optuna.pruners.NopPruner"


@dataclass
class MedianPrunerConfig(PrunerConfig):
    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    interval_steps: int = 1
    n_min_trials: int = 1


@dataclass
class PercentilePrunerConfig(MedianPrunerConfig):
    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = 25.0


@dataclass
class SuccessiveHalvingPrunerConfig(PrunerConfig):
    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    min_resource: Any = "auto"
    reduction_factor: int = 4
    min_early_stopping_rate: int = 0
    bootstrap_count: int = 0


@dataclass
class HyperbandPrunerConfig(PrunerConfig):
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: int = 1
    max_resource: Any = "auto"  # in the unit trials report at; runner: trainer.max_epochs for per-epoch runs
    reduction_factor: int = 3
    bootstrap_count: int = 0


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.runner_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sweeper builds sampler and pruner itself (and sends the pruner's config to jobs)
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "none"}])

    sampler: SamplerConfig = MISSING  # hydra/sweeper/sampler: tpe, random, cmaes, nsgaii, grid, gp, qmc (motpe: gone)
    pruner: PrunerConfig = MISSING    # hydra/sweeper/pruner: none, median, percentile, successive_halving, hyperband
    direction: Any = None             # minimize | maximize, or a list for several objectives; null: the
                                      # run's objective.direction (runner's jobs), else minimize
    # Optuna storage. null: a new study for this sweep, in the journal file <sweep dir>/optuna.journal
    # (name that file here to resume the study). A named storage resumes (or joins) study_name: a
    # file path is a journal file (safe for parallel slots and several sweep processes on one
    # machine); an RDB URL (postgresql://user:pass@host/db for many machines; sqlite:///x.db for
    # one writer); redis://.
    storage: Optional[str] = None
    study_name: Optional[str] = None  # name it to resume or share a study; null: a fresh random name
    n_trials: int = 20                # trials of the study in total, across resumed and shared sweeps
    n_jobs: int = 1                   # trials running at once; -1: one per GPU (else per CPU core)
    max_failure_rate: float = 0.0     # stop once more than this share of n_trials has FAILED (0: at the first)
    params: Optional[Dict[str, Any]] = None  # key -> override grammar: choice, range, interval, tag(log, ...), int(...)
    search_space: Optional[Dict[str, Any]] = None  # hydra-optuna-sweeper 1.1's form, deprecated: use params
    custom_search_space: Optional[str] = None  # dotpath to fn(cfg: DictConfig, trial: optuna.Trial) -> None
    heartbeat_interval: Optional[int] = 30  # seconds (>= 1) between a running trial's heartbeats; null: off
    grace_period: Optional[int] = None      # a trial silent this long was killed: FAIL (default 2 x interval)
    max_retry: int = 0                      # re-run a killed trial up to this many times (same params)


_SAMPLERS = {"tpe": TPESamplerConfig, "random": RandomSamplerConfig, "cmaes": CmaEsSamplerConfig,
             "nsgaii": NSGAIISamplerConfig, "grid": GridSamplerConfig, "gp": GPSamplerConfig,
             "qmc": QMCSamplerConfig, "motpe": MOTPESamplerConfig}
_PRUNERS = {"none": NopPrunerConfig, "median": MedianPrunerConfig, "percentile": PercentilePrunerConfig,
            "successive_halving": SuccessiveHalvingPrunerConfig, "hyperband": HyperbandPrunerConfig}

def hydra_optuna_sweeper_installed() -> bool:
    """Whether hydra-optuna-sweeper is installed beside: then `hydra/sweeper=optuna` and the sampler
    names both plugins define (tpe, random, cmaes, nsgaii, motpe, grid) stay its own."""
    import importlib.util

    return importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None


def store_configs(store: ConfigStore, alias: bool) -> None:
    """`hydra/sweeper=runner_optuna`, and `optuna` too when `alias` (no other plugin owns that name).
    Without the alias the sampler names the other plugin defines are left to it: this sweeper reads
    its sampler configs (a _target_ and keyword arguments) as its own."""
    names = ["runner_optuna", "optuna"] if alias else ["runner_optuna"]
    for name in names:
        store.store(group="hydra/sweeper", name=name, node=OptunaSweeperConf, provider="runner_optuna_sweeper")
    for _name, _node in _SAMPLERS.items():
        if alias or _name not in HYDRA_OPTUNA_SWEEPER_SAMPLERS:
            store.store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="runner_optuna_sweeper")
    for _name, _node in _PRUNERS.items():
        store.store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="runner_optuna_sweeper")


HYDRA_OPTUNA_SWEEPER_SAMPLERS = ("tpe", "random", "cmaes", "nsgaii", "motpe", "grid")
store_configs(ConfigStore.instance(), alias=not hydra_optuna_sweeper_installed())
