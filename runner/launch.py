"""From a composed config to a finished run: build the spec, write spec.yaml, run the engine."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.engine import Engine, RunResult
from runner.spec import RunSpec
from runner.tracking import build_tracker
from runner.trial import parent_run_id

log = logging.getLogger(__name__)


def spec_from_hydra(cfg: DictConfig) -> RunSpec:
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    container = OmegaConf.to_container(cfg, resolve=True)
    container["run_dir"] = hydra_cfg.runtime.output_dir
    return RunSpec.from_config(container, tuple(hydra_cfg.overrides.task))


def run(spec: RunSpec) -> RunResult:
    """Run one spec in this process. Everything is built and checked before a tracking run exists."""
    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.yaml").write_text(spec.to_yaml())
    engine = Engine(spec, build_tracker(spec, parent_run_id=parent_run_id(spec)))
    result = engine.fit()
    print_summary(spec, result, engine.tracker.describe())
    return result


def print_summary(spec: RunSpec, result: RunResult, tracking: str) -> None:
    metric = spec.objective.metric
    best_step = f" (step {result.best_step[metric]})" if metric in result.best_step else ""
    final = "  ".join(f"{k} {v:.4f}" for k, v in result.final.items())
    print(f"runner: trained {result.steps} optimizer steps in {result.seconds:.1f} s\n"
          f"  best {metric}: {result.objective:.4f}{best_step}\n"
          f"  {final}\n"
          f"  run directory: {spec.run_dir}\n"
          f"  {tracking}", file=sys.stdout, flush=True)
