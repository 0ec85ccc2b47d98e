"""A kiln firing scored by its defects (lower is better): a toy objective for the sweeper's tests,
with an integer range, a choice of numbers, a log-scaled interval and a choice of names."""
import math

import hydra
from omegaconf import DictConfig

GLAZE_PENALTY = {"clear": 0.0, "celadon": 0.4, "tenmoku": 0.9}


def defects(peak: float, hold: float, ramp: float, glaze: str) -> float:
    return ((peak - 1220) / 40) ** 2 + abs(hold - 20) / 10 + (math.log10(ramp) + 1) ** 2 + GLAZE_PENALTY[glaze]


@hydra.main(version_base=None, config_path="conf", config_name="config")
def fire(cfg: DictConfig) -> float:
    return defects(cfg.peak, cfg.hold, cfg.ramp, cfg.glaze)


if __name__ == "__main__":
    fire()
