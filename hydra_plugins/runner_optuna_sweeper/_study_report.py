"""What a sweep leaves behind: the MLflow parent run (study name, sampler, pruner, search space)
with a child run per trial tagged by number, state and whether it is the best; Optuna's
optimization-history and parameter-importance plots; optimization_results.yaml in the sweep dir."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from runner.trial import PARENT_RUN_ATTR

from ._parent_run import ParentRun
from ._search_space import describe

log = logging.getLogger(__name__)


class StudyReport:
    def __init__(self, config: DictConfig, study: optuna.Study, storage_url: str, space: dict[str, BaseDistribution],
                 fixed: dict[str, str], settings: Any, pruner_cfg: dict):
        self.study, self.storage_url, self.space, self.fixed, self.settings = study, storage_url, space, fixed, settings
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self.pruner = pruner_cfg
        self.parent = ParentRun.from_config(config)

    def open_parent_run(self, reuse: Optional[str]) -> None:
        if self.parent is None:
            return
        sampler = type(self.study.sampler).__name__
        seed = OmegaConf.select(self.settings.sampler, "seed", default=None)
        pruner_args = {k: v for k, v in self.pruner.items() if k != "_target_"}
        pruner = f"{self.pruner['_target_'].split('.')[-1]}({', '.join(f'{k}={v}' for k, v in pruner_args.items())})"
        params = {"study_name": self.study.study_name, "storage": self.storage_url, "sampler": f"{sampler}(seed={seed})",
                  "pruner": pruner, "direction": ",".join(d.name.lower() for d in self.study.directions),
                  "n_jobs": self.settings.n_jobs,
                  **{f"search_space.{k}": describe(d) for k, d in self.space.items()},
                  **{f"fixed.{k}": v for k, v in self.fixed.items()}}
        tags = {"runner.sweeper": "optuna", "optuna.study_name": self.study.study_name, "optuna.sampler": sampler,
                "optuna.pruner": pruner, "optuna.storage": self.storage_url, "sweep_dir": str(self.sweep_dir),
                "n_trials": str(self.settings.n_trials)}
        run_id = self.parent.start(name=self.study.study_name, tags=tags, params=params, reuse=reuse)
        if run_id != reuse:
            self.study.set_user_attr(PARENT_RUN_ATTR, run_id)

    def finish(self, status: str, n_trials: int) -> None:
        """Never raises: the sweep's own outcome (or error) is what the user must see."""
        files: list[Path] = []
        for step in (self._write_results, self._plot_history, self._plot_importances):
            try:
                path = step()
                if path is not None:
                    files.append(path)
            except Exception as e:  # noqa: BLE001
                log.warning(f"{step.__name__.strip('_').replace('_', ' ')}: skipped ({type(e).__name__}: {e})")
        if self.parent is None or self.parent.run_id is None:
            return
        try:
            self._tag_children_and_parent(files)
        except Exception as e:  # noqa: BLE001
            log.warning(f"MLflow: could not tag the sweep's runs ({type(e).__name__}: {e})")
        finally:
            self.parent.finish(status)

    # --- outputs ---------------------------------------------------------------------------------

    def _write_results(self) -> Path:
        trials = self.study.get_trials(deepcopy=False)
        counts = {s.name: sum(1 for t in trials if t.state == s) for s in TrialState if any(t.state == s for t in trials)}
        results: dict[str, Any] = {"name": "optuna", "study_name": self.study.study_name, "storage": self.storage_url}
        if len(self.study.directions) == 1:
            best = self._best()
            results.update(best_params=best.params if best else None, best_value=best.value if best else None,
                           best_trial=best.number if best else None)
            if best:
                log.info(f"Best parameters: {best.params}")
                log.info(f"Best value: {best.value}")
        else:
            front = self.study.best_trials
            results["solutions"] = [{"params": t.params, "values": t.values, "trial": t.number} for t in front]
            log.info(f"Number of Pareto solutions: {len(front)}")
        results["trials"] = counts
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        path = self.sweep_dir / "optimization_results.yaml"
        OmegaConf.save(OmegaConf.create(results), path)
        return path

    def _plot_history(self) -> Optional[Path]:
        if len(self.study.directions) > 1 or self._best() is None:
            return None
        from optuna.visualization.matplotlib import plot_optimization_history

        return self._save(plot_optimization_history(self.study), "optimization_history.png")

    def _plot_importances(self) -> Optional[Path]:
        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if len(self.study.directions) > 1 or len(complete) < 2 or not self.space:
            return None
        from optuna.visualization.matplotlib import plot_param_importances

        return self._save(plot_param_importances(self.study), "param_importances.png")

    def _save(self, axes: Any, name: str) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        path = self.sweep_dir / name
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path

    def _best(self) -> Optional[optuna.trial.FrozenTrial]:
        try:
            return self.study.best_trial
        except ValueError:  # no COMPLETE trial yet
            return None

    def _tag_children_and_parent(self, files: list[Path]) -> None:
        assert self.parent is not None
        client, trials = self.parent.client, {t.number: t for t in self.study.get_trials(deepcopy=False)}
        best = {t.number for t in self.study.best_trials} if len(self.study.directions) > 1 else (
            {self._best().number} if self._best() else set())
        for run in self.parent.children():
            number = run.data.params.get("trial.number")
            if number is None or not number.isdigit() or int(number) not in trials:
                continue
            t = trials[int(number)]
            for key, value in {"optuna.trial": number, "optuna.state": t.state.name, "optuna.best": str(t.number in best).lower(),
                               "optuna.params": json.dumps(t.params)}.items():
                client.set_tag(run.info.run_id, key, value)
            if run.info.status == "RUNNING" and t.state == TrialState.FAIL:  # its process was killed
                client.set_terminated(run.info.run_id, status="KILLED")
        states = [t.state for t in trials.values()]
        for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
            client.log_metric(self.parent.run_id, f"trials_{state.name.lower()}", states.count(state))
        top = self._best() if len(self.study.directions) == 1 else None
        if top is not None:
            client.log_metric(self.parent.run_id, "best_value", top.value)
            client.set_tag(self.parent.run_id, "best_trial", str(top.number))
            for key, value in top.params.items():
                client.set_tag(self.parent.run_id, f"best.{key}", str(value))
        for path in files:
            self.parent.log_artifact(path)
