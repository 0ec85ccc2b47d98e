"""Sampler and pruner from their configs (the sweeper conf is not instantiated recursively: the
pruner's config itself travels to the jobs through the study)."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import optuna
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from .config import MOTPE_REMOVED
from .hook import SweepConfigError


REMOVED_SAMPLERS = {  # hydra-optuna-sweeper offered them; the installed Optuna no longer has them
    target: MOTPE_REMOVED
    for target in ("optuna.samplers.MOTPESampler", "hydra_plugins.runner_optuna_sweeper.config.raise_motpe_removed",
                   "hydra_plugins.hydra_optuna_sweeper.config.raise_motpe_removed")  # theirs, when both are installed
}


def check_sampler(cfg: DictConfig) -> None:
    target = str(OmegaConf.select(cfg, "_target_", default=""))
    if target in REMOVED_SAMPLERS:
        raise SweepConfigError(f"hydra/sweeper/sampler: {REMOVED_SAMPLERS[target]}")


def build_sampler(cfg: DictConfig, grid: Optional[dict[str, list]] = None, seed: Optional[int] = None) -> optuna.samplers.BaseSampler:
    """The sampler from its config; null fields take Optuna's defaults. `seed` replaces the
    configured one (see _study.seed_for: sweep processes sharing a study seed differently)."""
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if v is not None}
    cls = get_class(kwargs.pop("_target_"))
    kwargs.pop("_partial_", None)
    if seed is not None:
        kwargs["seed"] = seed
    if grid is not None:
        kwargs["search_space"] = grid
    kwargs = {k: instantiate(v) if isinstance(v, dict) and "_target_" in v else v for k, v in kwargs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return cls(**kwargs)


def pruner_config(cfg: Optional[DictConfig], config: DictConfig) -> dict:
    """The pruner's config as jobs will build it. Hyperband's resource must be counted in the unit the
    trials report at (runner/search/trial.py): a runner run that evaluates once per epoch reports at
    epochs done, so max_resource is trainer.max_epochs, known from the start; a k-fold run reports at
    its fold index, so it is the fold count. Elsewhere (mid-epoch evaluations report at optimizer steps,
    other apps at whatever step they report) max_resource stays 'auto': Optuna takes the last step the
    first finished trial reported, in the trials' own unit."""
    pruner = OmegaConf.to_container(cfg, resolve=True) if cfg else {"_target_": "optuna.pruners.NopPruner"}
    epochs = OmegaConf.select(config, "trainer.max_epochs", default=None)
    folds = OmegaConf.select(config, "trainer.cross_validation.folds", default=None)
    per_epoch = (OmegaConf.select(config, "trainer.eval_every_n_steps", default=None) == 0
                 and OmegaConf.select(config, "trainer.max_steps", default=0) is None)
    if pruner["_target_"].endswith("HyperbandPruner") and pruner.get("max_resource") == "auto":
        if folds and int(folds) > 1:
            pruner["max_resource"] = int(folds)
        elif epochs and per_epoch:
            pruner["max_resource"] = int(epochs)
    return pruner


def build_pruner(config: dict) -> Any:
    """The pruner; Optuna's complaint about an argument (Hydra wraps it in a wall of lines) as one line."""
    try:
        return instantiate(config)
    except Exception as e:
        target = str(config.get("_target_", "?"))
        cause = e.__cause__ or e
        if isinstance(cause, ImportError) or "Error locating target" in str(e):
            raise SweepConfigError(f"hydra.sweeper.pruner._target_: {target!r} cannot be imported; allowed: a pruner "
                                   "class such as optuna.pruners.MedianPruner, or hydra/sweeper/pruner=none, median, "
                                   "percentile, successive_halving or hyperband") from None
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise SweepConfigError(f"hydra.sweeper.pruner: {target.split('.')[-1]}: {reason}") from None
