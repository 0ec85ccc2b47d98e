"""optimization_results.yaml in the sweep directory, as hydra-optuna-sweeper writes it: the best
parameters and value (or the Pareto front for several objectives), and the count of trials by state."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import optuna
from omegaconf import OmegaConf
from optuna.trial import TrialState

log = logging.getLogger(__name__)


def write_results(study: optuna.Study, storage_url: str, sweep_dir: Path) -> Optional[Path]:
    """The file's path; None (and a warning) when it cannot be written. Never raises: the sweep's own
    outcome is what the user must see."""
    try:
        trials = study.get_trials(deepcopy=False)
        results: dict[str, Any] = {"name": "optuna", "study_name": study.study_name, "storage": storage_url}
        if len(study.directions) == 1:
            best = [t for t in trials if t.state == TrialState.COMPLETE] and study.best_trial
            results.update(best_params=best.params if best else None, best_value=best.value if best else None,
                           best_trial=best.number if best else None)
            if best:
                log.info(f"Best parameters: {best.params}")
                log.info(f"Best value: {best.value}")
        else:
            front = study.best_trials
            results["solutions"] = [{"params": t.params, "values": t.values, "trial": t.number} for t in front]
            log.info(f"Number of Pareto solutions: {len(front)}")
        results["trials"] = {s.name: n for s in TrialState if (n := sum(t.state == s for t in trials))}
        sweep_dir.mkdir(parents=True, exist_ok=True)
        path = sweep_dir / "optimization_results.yaml"
        OmegaConf.save(OmegaConf.create(results), path)
        return path
    except Exception as e:  # noqa: BLE001
        log.warning(f"optimization_results.yaml: not written ({type(e).__name__}: {e})")
        return None
