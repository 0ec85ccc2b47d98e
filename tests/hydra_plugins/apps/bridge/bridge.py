"""A footbridge: two objectives, its mass and its sag under load, both to be minimized; a deeper
girder sags less but weighs more."""
from typing import Tuple

import hydra
from omegaconf import DictConfig

DENSITY = {"steel": 7.85, "timber": 0.6}
STIFFNESS = {"steel": 200.0, "timber": 11.0}


def mass_and_sag(depth: float, width: float, material: str) -> Tuple[float, float]:
    mass = DENSITY[material] * depth * width * 12
    sag = 100.0 / (STIFFNESS[material] * width * depth ** 3)
    return mass, sag


@hydra.main(version_base=None, config_path="conf", config_name="config")
def bridge(cfg: DictConfig) -> Tuple[float, float]:
    return mass_and_sag(cfg.depth, cfg.width, cfg.material)


if __name__ == "__main__":
    bridge()
