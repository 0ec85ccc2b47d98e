"""A run that is one trial of an Optuna study (hparams_search).

The sweeper hands the job three overrides, `trial.storage`, `trial.study_name` and `trial.number`;
the job opens the study's storage itself, so reporting and pruning work whatever the launcher
(in-process, a spawned process per slot, a SLURM job): nothing is shared in memory. After every
evaluation the objective metric is reported to the trial at the run's resource, the unit the pruner
counts in: epochs done where the run evaluates once per epoch (trainer.eval_every_n_steps=0, no
max_steps: the sweeper sets Hyperband's max_resource to trainer.max_epochs, and epochs compare
trials whose batch size, hence steps per epoch, differ), else its optimizer step (Hyperband's
max_resource then comes from the first finished trial, in steps). A resumed or restarted run reports
new epochs or steps, never ones Optuna has seen. The study's pruner is asked, by
the trial's engine add-on (`TrialReporter`, registered by runner/cli/launch.py's build_engine), after
every evaluation but the one at the run's last step (a trial that has done all its work completes); a
rejected trial stops the loop, which ends it as a FINISHED MLflow run tagged `pruned`, and the launch
raises `optuna.TrialPruned` for the sweeper to tell as PRUNED.

The pruner lives in the sweeper's config, not in the storage, so the sweeper writes its config to
the study's user attributes (`PRUNER_ATTR`) and every job builds the same pruner from it. The job
writes its MLflow run id (`MLFLOW_RUN_ATTR`, once the run is open) and its run directory (`RUN_DIR_ATTR`)
into the trial's system attributes: whichever sweep process fails a stale trial (its node died, its run
directory on that node's disk) ends the trial's MLflow run KILLED from the storage alone.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra_plugins.runner_optuna_sweeper.storage import PRUNER_ATTR, open_storage, storage_url  # the sweeper's protocol
from runner.addons.base import AddOn, EngineView, Progress, Stop

if TYPE_CHECKING:
    from runner.specs.run import RunSpec

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "RUNNER_PARENT_RUN_ID"      # MLflow parent run of the sweep this job belongs to
PARENT_RUN_ATTR = "runner.mlflow_parent_run"  # study user attr: the sweep's MLflow parent run id
RUN_DIR_ATTR = "runner.run_dir"               # trial system attr: the job's run directory
MLFLOW_RUN_ATTR = "runner.mlflow_run"         # trial system attr: the job's MLflow run id


def is_pruned(error: BaseException) -> bool:
    """Whether an exception is Optuna's prune signal (without importing optuna into plain runs)."""
    optuna = sys.modules.get("optuna")
    return optuna is not None and isinstance(error, optuna.TrialPruned)


class TrialReporter(AddOn):
    """Reports a run's evaluations to its trial (`report`) and says whether the pruner stops it (`verdict`).
    An engine add-on (runner/addons/base.py) that the launch registers for a trial's run: after each
    validation it reports and returns the pruner's stop.

    Under ddp/fsdp every rank holds one (their metrics are all-reduced, hence equal): rank 0 alone
    reports and asks the pruner, and broadcasts the verdict, so all ranks stop at the same step.
    """

    name = "optuna_trial"

    def __init__(self, trial: Any, metric: str, multi_objective: bool, distributed: bool, per_epoch: bool = False):
        self.trial, self.metric, self.multi_objective, self.distributed = trial, metric, multi_objective, distributed
        self.per_epoch = per_epoch  # report at epochs done, not at the optimizer step (module docstring)
        self.last: tuple[int, dict[str, float]] = (0, {})
        self.progress = Progress()
        self.total_steps: int | None = None  # the run's length, known once the engine is built
        self.tracker: Any = None
        self.recorded_run: str | None = None

    def setup(self, view: EngineView) -> None:
        self.progress, self.tracker, self.total_steps = view.progress, view.tracker, view.total_steps

    def on_epoch_start(self, epoch: int) -> None:
        self.record_run(getattr(self.tracker, "run_id", None))  # the run is open once training starts

    def record_run(self, run_id: str | None) -> None:
        """Keep the MLflow run id in the trial, in the study's storage, once: the sweep that fails this trial
        as stale may run on another machine than this job's run directory."""
        if self.trial is None or not run_id or run_id == self.recorded_run:
            return
        self.trial.storage.set_trial_system_attr(self.trial._trial_id, MLFLOW_RUN_ATTR, run_id)
        self.recorded_run = run_id

    def after_evaluation(self, metrics: dict[str, float]) -> Stop | None:
        self.record_run(getattr(self.tracker, "run_id", None))  # a run resumed mid-epoch starts no epoch first
        if not metrics:  # an empty split: nothing to report
            return None
        self.report(metrics, self.progress.epoch if self.per_epoch else self.progress.step)
        verdict = self.verdict()
        return Stop(verdict, pruned=True) if verdict else None

    def report(self, metrics: dict[str, float], step: int) -> None:
        """The objective at this resource: an epoch count, an optimizer step, a k-fold run's fold (Optuna
        prunes single objectives only)."""
        self.last = (step, metrics)
        value = metrics.get(self.metric)
        if self.trial is not None and value is not None and math.isfinite(value) and not self.multi_objective:
            self.trial.report(value, step)

    def verdict(self) -> str | None:
        """Why the study's pruner stops this run after the last report, or None to go on."""
        step, metrics = self.last
        for name, value in metrics.items():
            if not math.isfinite(value):  # a diverged run: FAIL now rather than train on NaN
                raise FloatingPointError(f"the run diverged: {name} is {value} at step {step}")
        verdict = None
        # a trial that has done all its work completes: pruning saves no compute then, and would lose its value
        done = self.total_steps is not None and self.progress.step >= self.total_steps
        if (self.trial is not None and self.metric in metrics and not self.multi_objective and not done
                and self.trial.should_prune()):
            where = f"epoch {step} (step {self.progress.step})" if self.per_epoch else f"step {step}"
            verdict = f"trial {self.trial.number} pruned at {where}: {self.metric} {metrics[self.metric]:.4f}"
        if self.distributed:
            from runner.engine.parallel import broadcast_object

            verdict = broadcast_object(verdict)
        return verdict


def pruned(reason: str) -> BaseException:
    """Optuna's prune signal: how a job tells the sweeper that its trial was pruned."""
    import optuna

    return optuna.TrialPruned(reason)


def open_trial(spec: "RunSpec") -> TrialReporter | None:
    """The reporter for this run's trial, or None when the run is not a trial."""
    t = spec.trial
    if t.number is None or t.study_name is None:
        return None
    _check_storage(spec)
    distributed, rank = _rank()
    metric = spec.objective.metric
    if rank != 0:
        return TrialReporter(None, metric, False, distributed)
    import optuna
    from hydra.utils import instantiate

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(storage_url(t.storage))
    study = optuna.load_study(study_name=t.study_name, storage=storage)
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(t.study_name), t.number)
    state = storage.get_trial(trial_id).state
    if state != optuna.trial.TrialState.RUNNING:
        log.warning("trial %d of study %r is %s, not RUNNING: this run will not report to it",
                    t.number, t.study_name, state.name)
        return TrialReporter(None, metric, False, distributed)
    storage.set_trial_system_attr(trial_id, RUN_DIR_ATTR, str(Path(spec.run_dir).resolve()))
    pruner = study.user_attrs.get(PRUNER_ATTR)
    study.pruner = instantiate(pruner) if pruner else optuna.pruners.NopPruner()
    return TrialReporter(optuna.trial.Trial(study, trial_id), metric, len(study.directions) > 1, distributed,
                         per_epoch=reports_per_epoch(spec))


def reports_per_epoch(spec: "RunSpec") -> bool:
    """Whether the run's trial counts its resource in epochs: it evaluates once per epoch and trains by
    epochs (the sweeper's pruner_config reads the same two keys)."""
    return spec.trainer.eval_every_n_steps == 0 and spec.trainer.max_steps is None


def _rank() -> tuple[bool, int]:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return False, 0
    return True, dist.get_rank()


def parent_run_id(spec: "RunSpec") -> str | None:
    """The MLflow parent run a sweep's job logs under: from the sweep process's environment, or,
    for a job that runs elsewhere, from its study's user attributes. A k-fold run's fold: its K-fold run."""
    if spec.trainer.cross_validation.parent_run:
        return spec.trainer.cross_validation.parent_run
    if os.environ.get(PARENT_RUN_ENV):
        return os.environ[PARENT_RUN_ENV]
    t = spec.trial
    if t.number is None or t.study_name is None or spec.tracking.name == "none":
        return None
    _check_storage(spec)
    import optuna

    study = optuna.load_study(study_name=t.study_name, storage=open_storage(storage_url(t.storage)))
    return study.user_attrs.get(PARENT_RUN_ATTR)


def _check_storage(spec: "RunSpec") -> None:
    if spec.trial.storage is None:
        from runner.specs.run import SpecError

        raise SpecError(f"trial.storage: null, but trial.study_name={spec.trial.study_name!r} and trial.number="
                        f"{spec.trial.number} are set; name the study's Optuna storage too (the sweeper sets all three)")
