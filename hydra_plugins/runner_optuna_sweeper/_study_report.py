"""What a sweep leaves behind: optimization_results.yaml in the sweep directory, and in MLflow a
parent run (study name, sampler, pruner, search space) with a child run per trial.

The report is written as the sweep goes, not after it: as each trial ends its child run is tagged
(optuna.trial, optuna.state, optuna.params) and the parent logs the trial's value and the best value
so far at step = trial number, which MLflow's UI draws as the optimization history. The end of the
sweep then costs a few MLflow calls (well under a second), where rendering Optuna's matplotlib plots
took 5-13 s per sweep; parameter importances are drawn where they are looked at (optuna-dashboard on
the study's storage, or the MLflow UI's comparison of the child runs).

A trial FAIL in the study never keeps a FINISHED or RUNNING MLflow run: a trial whose process was
killed (or whose sweep was, found later by its stale heartbeat) ends KILLED, tagged
runner.outcome=killed; one whose job finished but returned no usable value ends FAILED. Pruned
runs are tagged and renamed by the engine itself (runner.outcome=pruned); the sweeper adds only
optuna.state=PRUNED and counts them (trials_pruned).
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Optional

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from runner.tracking import RUN_FILE
from runner.trial import PARENT_RUN_ATTR, RUN_DIR_ATTR

from ._parent_run import ParentRun
from ._search_space import describe

log = logging.getLogger(__name__)


class StudyReport:
    def __init__(self, config: DictConfig, study: optuna.Study, storage_url: str, space: dict[str, BaseDistribution],
                 fixed: dict[str, str], settings: Any, pruner_cfg: dict, seed: Optional[int]):
        self.study, self.storage_url, self.space, self.fixed, self.settings = study, storage_url, space, fixed, settings
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self.pruner, self.seed = pruner_cfg, seed
        self.parent = ParentRun.from_config(config)
        self.single = len(study.directions) == 1
        self.best_so_far = _best(study) if self.single else None
        self.lock = threading.Lock()  # slot threads report trials concurrently through one MLflow client

    def open_parent_run(self, reuse: Optional[str]) -> None:
        if self.parent is None:
            return
        sampler = type(self.study.sampler).__name__
        pruner_args = {k: v for k, v in self.pruner.items() if k != "_target_"}
        pruner = f"{self.pruner['_target_'].split('.')[-1]}({', '.join(f'{k}={v}' for k, v in pruner_args.items())})"
        params = {"study_name": self.study.study_name, "storage": self.storage_url, "sampler": f"{sampler}(seed={self.seed})",
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

    # --- as trials end -----------------------------------------------------------------------

    def trial_done(self, trial: FrozenTrial, killed: bool = False) -> None:
        """Tag the trial's MLflow run and log its value on the parent. Never raises."""
        if self.parent is None or self.parent.run_id is None:
            return
        try:
            with self.lock:
                self._tag_child(trial, killed)
                self._log_on_parent(trial)
        except Exception as e:  # noqa: BLE001 - MLflow trouble must not end the sweep
            log.warning(f"MLflow: could not record trial {trial.number} ({type(e).__name__}: {e})")

    def _tag_child(self, trial: FrozenTrial, killed: bool) -> None:
        run_id = trial_run_id(trial)
        if run_id is None:
            return
        client = self.parent.client
        tags = {"optuna.trial": str(trial.number), "optuna.state": trial.state.name, "optuna.best": "false",
                "optuna.params": json.dumps(trial.params)}
        status = client.get_run(run_id).info.status
        if trial.state == TrialState.FAIL and status in ("RUNNING", "FINISHED"):
            tags["runner.outcome"] = "killed" if killed or status == "RUNNING" else "failed"
        _set_tags(client, run_id, tags)
        if "runner.outcome" in tags:
            client.set_terminated(run_id, status="KILLED" if tags["runner.outcome"] == "killed" else "FAILED")

    def _log_on_parent(self, trial: FrozenTrial) -> None:
        if trial.state != TrialState.COMPLETE:
            return
        from mlflow.entities import Metric

        metrics = [Metric(f"objective_{i}", v, 0, trial.number) for i, v in enumerate(trial.values)]
        if self.single:
            metrics = [Metric("trial_value", trial.value, 0, trial.number)]
            better = self.study.direction == optuna.study.StudyDirection.MAXIMIZE
            if self.best_so_far is None or (trial.value > self.best_so_far if better else trial.value < self.best_so_far):
                self.best_so_far = trial.value
            metrics.append(Metric("best_value", self.best_so_far, 0, trial.number))
        self.parent.client.log_batch(self.parent.run_id, metrics=metrics)

    # --- at the end ----------------------------------------------------------------------------

    def finish(self, status: str) -> None:
        """Never raises: the sweep's own outcome (or error) is what the user must see."""
        results = None
        try:
            results = self._write_results()
        except Exception as e:  # noqa: BLE001
            log.warning(f"optimization_results.yaml: not written ({type(e).__name__}: {e})")
        if self.parent is None or self.parent.run_id is None:
            return
        try:
            with self.lock:
                self._summarize_on_parent(results)
        except Exception as e:  # noqa: BLE001
            log.warning(f"MLflow: could not summarize the study on its parent run ({type(e).__name__}: {e})")
        finally:
            self.parent.finish(status)

    def _write_results(self) -> Path:
        trials = self.study.get_trials(deepcopy=False)
        counts = {s.name: sum(1 for t in trials if t.state == s) for s in TrialState if any(t.state == s for t in trials)}
        results: dict[str, Any] = {"name": "optuna", "study_name": self.study.study_name, "storage": self.storage_url}
        if self.single:
            best = _best_trial(self.study)
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

    def _summarize_on_parent(self, results: Optional[Path]) -> None:
        from mlflow.entities import Metric, RunTag

        client, run_id = self.parent.client, self.parent.run_id
        trials = self.study.get_trials(deepcopy=False)
        metrics = [Metric(f"trials_{s.name.lower()}", sum(t.state == s for t in trials), 0, 0)
                   for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)]
        best = [t for t in [_best_trial(self.study)] if t] if self.single else self.study.best_trials
        before = client.get_run(run_id).data.tags.get("best_trial", "")
        tags = [RunTag("best_trial", ",".join(str(t.number) for t in best))]
        if self.single and best:
            metrics.append(Metric("best_value", best[0].value, 0, max(t.number for t in trials)))
            tags += [RunTag(f"best.{k}", str(v)[:5000]) for k, v in best[0].params.items()]
        client.log_batch(run_id, metrics=metrics, tags=tags)
        now = {t.number for t in best}
        was = {int(n) for n in before.split(",") if n.isdigit()}
        by_number = {t.number: t for t in trials}
        for number, flag in [(n, "false") for n in was - now] + [(n, "true") for n in now - was]:
            child = trial_run_id(by_number[number]) if number in by_number else None
            if child is not None:
                client.set_tag(child, "optuna.best", flag)
        if results is not None:
            self.parent.log_artifact(results)


def trial_run_id(trial: FrozenTrial) -> Optional[str]:
    """The trial's MLflow run: its job wrote its run directory into the trial (runner.trial), and
    the run directory names its MLflow run."""
    run_dir = trial.system_attrs.get(RUN_DIR_ATTR)
    run_file = Path(run_dir) / RUN_FILE if run_dir else None
    return run_file.read_text().strip() if run_file is not None and run_file.exists() else None


def _set_tags(client: Any, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, v[:5000]) for k, v in tags.items()])


def _best_trial(study: optuna.Study) -> Optional[FrozenTrial]:
    try:
        return study.best_trial
    except ValueError:  # no COMPLETE trial yet
        return None


def _best(study: optuna.Study) -> Optional[float]:
    best = _best_trial(study)
    return best.value if best else None
