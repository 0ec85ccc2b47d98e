"""An orchard's yield (higher is better), with a search space that a function completes: how many
pruning passes to try depends on the number of rows the trial picked."""
import hydra
from omegaconf import DictConfig
from optuna.trial import Trial


def harvest(rows: int, spacing: float, passes: int, thinning: float) -> float:
    return rows * 10 - (spacing - 3.5) ** 2 * 4 + passes * 1.5 - passes ** 2 * 0.1 - abs(thinning - 0.3) * 8


@hydra.main(version_base=None, config_path="conf", config_name="config")
def orchard(cfg: DictConfig) -> float:
    return harvest(cfg.rows, cfg.spacing, cfg.passes, cfg.thinning)


def plan(cfg: DictConfig, trial: Trial) -> None:
    """hydra.sweeper.custom_search_space: called for every trial after `params` are sampled."""
    trial.suggest_int("passes", 1, trial.params["rows"])
    trial.suggest_float("+thinning", 0.0, cfg.max_thinning)  # '+': the key is not in the config


if __name__ == "__main__":
    orchard()
