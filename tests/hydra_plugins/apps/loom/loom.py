"""A loom whose cloth is scored by its flaws (lower is better). Its config has top-level `trial` and
`tracking` nodes of its own, as a user's app may: the sweeper must leave them alone (no trial.*
overrides, no MLflow parent run), since only an app that declares a sweep hook gets runner's extras."""
import hydra
from omegaconf import DictConfig


def flaws(tension: float, picks: int, pattern: str) -> float:
    return (tension - 3.0) ** 2 + abs(picks - 24) / 8 + (0.5 if pattern == "satin" else 0.0)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def weave(cfg: DictConfig) -> float:
    assert set(cfg.trial) == {"pattern", "warp"} and cfg.tracking.name == "mlflow"  # the user's own nodes, untouched
    return flaws(cfg.tension, cfg.picks, cfg.trial.pattern)


if __name__ == "__main__":
    weave()
