"""A dart's squared distance from the bullseye (lower is better); with `error=true` every throw
raises, and `objectives=2` also scores the distance from a second bull at (1, 1)."""
import hydra
from omegaconf import DictConfig


def throw(cfg: DictConfig):
    if cfg.get("error", False):
        raise RuntimeError("cfg.error is True")
    bullseye = float(cfg.x) ** 2 + float(cfg.y) ** 2
    if cfg.get("objectives", 1) == 2:
        return bullseye, (float(cfg.x) - 1) ** 2 + (float(cfg.y) - 1) ** 2
    return bullseye


main = hydra.main(version_base=None, config_path="conf", config_name="config")(throw)

if __name__ == "__main__":
    main()
