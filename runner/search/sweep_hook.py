"""runner's side of a multirun: the MLflow parent run, and what the Optuna sweeper adds to runner's
jobs (trial.* overrides so each job reports to its trial, the objective's direction).

The objective's direction is resolved once per sweep, as every job resolves it (the task's declaration
for objective.metric: runner/specs/metric_names.py), and is what the study optimizes and what picks a
grid's best job.

The Optuna sweeper knows nothing of runner: runner's task function declares `RunnerSweepHook`
(runner/__main__.py, `@sweep_hook`), and the sweeper calls it. A plain grid multirun gets its parent
from `ParentRunCallback` (conf/config.yaml: hydra.callbacks). Jobs find their parent through the
RUNNER_PARENT_RUN_ID environment variable (runner.search.trial), set here in the sweep process before any
job starts, or, for jobs that run elsewhere, through the study's user attributes.

Every trial FAIL in the study ends with its MLflow run KILLED (its process was killed, or its sweep
was: found later by its stale heartbeat), tagged runner.outcome=killed, or FAILED when its job ended
without a usable value; pruned runs are tagged by the engine itself. As each trial ends, the parent
logs its value and the best so far at step = trial number (the UI's optimization history).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.runner_optuna_sweeper.hook import SweepConfigError, SweepHook
from hydra_plugins.runner_optuna_sweeper.storage import once_per_study, open_storage
from runner.specs.fields import SpecError
from runner.tracking.mlflow_store import open_client, open_experiment, owner_tags
from runner.search.sweep_summary import Job, best_job, log_jobs_table, mark_best, print_summary, run_link
from runner.tracking.tracker import RUN_FILE, run_exists
from runner.search.trial import MLFLOW_RUN_ATTR, PARENT_RUN_ATTR, PARENT_RUN_ENV, RUN_DIR_ATTR

log = logging.getLogger(__name__)


class ParentRun:
    def __init__(self, uri: str, experiment: str, artifact_root: str):
        self.uri, self.experiment, self.artifact_root = uri, experiment, artifact_root
        self.client = open_client(uri)  # the one way into the store: its lock, and orphaned runs ended
        self.run_id: str | None = None

    @classmethod
    def from_config(cls, config: DictConfig) -> ParentRun | None:
        """From runner's `tracking` node; None with tracking=none."""
        if OmegaConf.select(config, "tracking.name", default=None) != "mlflow":
            return None
        t = OmegaConf.to_container(config.tracking, resolve=True)
        return cls(t["uri"], t.get("experiment", "runner"), t.get("artifact_root", "outputs/mlartifacts"))

    def start(self, name: str, tags: dict[str, str], params: dict[str, Any], reuse: str | None = None) -> str:
        """Open the parent (or reopen `reuse` when it still exists) and publish it to jobs."""
        from mlflow.entities import Param, RunTag

        tags = {**tags, **owner_tags()}
        if reuse and run_exists(self.client, reuse):
            self.run_id = reuse
            self.client.update_run(reuse, status="RUNNING")
            if "runner.outcome" in self.client.get_run(reuse).data.tags:  # a killed sweep's ending is history now
                self.client.delete_tag(reuse, "runner.outcome")
        else:
            experiment = open_experiment(self.client, self.experiment, self.uri, self.artifact_root)
            self.run_id = self.client.create_run(experiment, run_name=name, tags=tags).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i:i + 100])
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])
        os.environ[PARENT_RUN_ENV] = self.run_id
        _open_parents.append(self)
        return self.run_id

    def finish(self, status: str) -> None:
        if os.environ.get(PARENT_RUN_ENV) == self.run_id:
            del os.environ[PARENT_RUN_ENV]
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)
            self.run_id = None
        if self in _open_parents:
            _open_parents.remove(self)


_open_parents: list[ParentRun] = []  # this process's parents not finished yet


def discard_childless_parents() -> None:
    """A launcher refused the sweep's submission (hydra_plugins/runner_slurm_launcher): a parent run opened for it
    that holds no child is deleted, not left FAILED beside the runs of sweeps that ran (nothing of it ran); a
    parent with children ends as it would."""
    for parent in list(_open_parents):
        run = parent.client.get_run(parent.run_id)
        children = parent.client.search_runs([run.info.experiment_id], max_results=1,
                                             filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'")
        if not children:
            parent.client.delete_run(parent.run_id)
            if os.environ.get(PARENT_RUN_ENV) == parent.run_id:
                del os.environ[PARENT_RUN_ENV]
            parent.run_id = None
            _open_parents.remove(parent)


JOB_FILE = "sweep_job.json"        # a grid job's outcome, written by the process that ran the job
MULTIRUN_ENV = "RUNNER_MULTIRUN_ID"  # names the multirun a job belongs to (a sweep directory may be reused)


class ParentRunCallback(Callback):
    """A grid multirun (`python -m runner -m optimizer=sgd,adamw`) as one MLflow parent run with a
    child per job, and the table of its jobs at the end. The Optuna sweeper's parent and table are
    RunnerSweepHook's, so it is skipped here.

    Hydra calls on_job_start/on_job_end in the process that runs the job (a joblib worker, a submitit
    job) and the multirun's own hooks in the sweep process: each job writes its outcome to JOB_FILE in
    its directory, and the sweep process reads them back from the sweep directory at the end. A job
    whose process died before it could write one counts failed."""

    def __init__(self) -> None:
        self.parent: ParentRun | None = None
        self.grid = False
        self.multirun_id = ""
        self.began = 0.0                    # wall clock: job directories older than the multirun are not its own
        self.job_began: dict[int, float] = {}
        self.maximize: bool | None = None  # the objective's resolved direction; None where it cannot be resolved

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_grid(config):  # each opens its own parent
            return
        self.grid = True
        self.began = time.time()
        # set before any job starts: jobs inherit it (joblib's workers, submitit's processes and SLURM jobs too)
        self.multirun_id = os.environ[MULTIRUN_ENV] = uuid.uuid4().hex
        try:
            self.maximize = sweep_objective(config).direction == "maximize"
        except SpecError as e:  # preflight refuses this before the sweep; a job will say it again
            log.warning(f"the multirun's best job is not marked: {e}")
        self.parent = ParentRun.from_config(config)
        if self.parent is None:
            return
        overrides = list(OmegaConf.select(config, "hydra.overrides.task", default=[]) or [])
        self.parent.start(name="multirun " + " ".join(overrides)[:200],
                          tags={"runner.sweeper": "basic", "overrides": " ".join(overrides) or "(none)",
                                "sweep_dir": str(config.hydra.sweep.dir)},
                          params={})
        atexit.register(self._finish_if_open, "FAILED")  # a job that raises ends the sweep before on_multirun_end

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if is_grid(config) and _multirun(config):
            self.job_began[int(OmegaConf.select(config, "hydra.job.num", default=-1))] = time.monotonic()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """In the job's own process: its outcome to JOB_FILE in its directory."""
        if not (is_grid(config) and _multirun(config)):
            return
        from hydra.core.utils import JobStatus

        number = int(OmegaConf.select(config, "hydra.job.num", default=-1))
        overrides = [o for o in job_return.overrides or [] if not o.startswith("hydra.")]
        done = job_return.status == JobStatus.COMPLETED
        try:
            objective = float(job_return.return_value) if done else None
        except (TypeError, ValueError):  # a task function of a plain Hydra app may return anything
            objective = None
        began = self.job_began.pop(number, None)
        outcome = {"multirun": os.environ.get(MULTIRUN_ENV, ""), "number": number, "overrides": overrides,
                   "objective": objective, "status": "complete" if done else "failed",
                   "seconds": None if began is None else time.monotonic() - began}
        job_dir = Path(OmegaConf.select(config, "hydra.runtime.output_dir", default="."))
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / JOB_FILE).write_text(json.dumps(outcome))
        except OSError as e:
            log.warning(f"the multirun's summary will count job {number} failed: cannot write {job_dir / JOB_FILE} ({e})")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.grid:
            return
        metric = str(OmegaConf.select(config, "objective.metric", default="objective"))
        sweep_dir, link = Path(str(config.hydra.sweep.dir)), None
        jobs = grid_jobs(sweep_dir, self.multirun_id, self.began)
        best = best_job(jobs, self.maximize) if self.maximize is not None else None
        if self.parent is not None and self.parent.run_id is not None:
            try:
                mark_best(self.parent.client, self.parent.run_id, jobs, best)
                log_jobs_table(self.parent.client, self.parent.run_id, jobs, metric, sweep_dir)
                link = run_link(self.parent.client, self.parent.uri, self.parent.run_id)
            except Exception as e:  # noqa: BLE001 - MLflow trouble must not hide the table
                log.warning(f"MLflow: could not summarize the multirun on its parent run ({type(e).__name__}: {e})")
        print_summary(jobs, best, metric, sweep_dir, link)
        self._finish_if_open("FINISHED")
        if os.environ.get(MULTIRUN_ENV) == self.multirun_id:
            del os.environ[MULTIRUN_ENV]

    def _finish_if_open(self, status: str) -> None:
        if self.parent is not None and self.parent.run_id is not None:
            self.parent.finish(status)


def is_grid(config: DictConfig) -> bool:
    """A multirun the ParentRunCallback summarizes: any sweeper but runner's Optuna and PBT sweepers."""
    target = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
    return "runner_optuna_sweeper" not in target and "runner_pbt_sweeper" not in target


def _multirun(config: DictConfig) -> bool:
    return str(OmegaConf.select(config, "hydra.mode", default="")).endswith("MULTIRUN")


def grid_jobs(sweep_dir: Path, multirun_id: str, began: float) -> list[Job]:
    """The jobs of multirun `multirun_id` from their JOB_FILEs under sweep_dir; a job directory of this
    multirun (Hydra wrote its .hydra/ after `began`) without one is a job whose process died: failed."""
    jobs: dict[str, Job] = {}
    for path in sweep_dir.rglob(JOB_FILE):
        try:
            outcome = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if outcome.get("multirun") != multirun_id:
            continue
        jobs[str(path.parent)] = _grid_job(path.parent, outcome["number"], outcome["overrides"], outcome["objective"],
                                           outcome["status"], outcome["seconds"])
    for path in sweep_dir.rglob(".hydra/overrides.yaml"):
        job_dir = path.parent.parent
        if str(job_dir) in jobs or _mtime(path) < began - 1.0 or (job_dir / JOB_FILE).exists():
            continue
        try:
            import yaml

            overrides = [o for o in yaml.safe_load(path.read_text()) or [] if not o.startswith("hydra.")]
            number = int(yaml.safe_load((path.parent / "hydra.yaml").read_text())["hydra"]["job"]["num"])
        except Exception:  # noqa: BLE001  (not a job directory of Hydra's making)
            continue
        jobs[str(job_dir)] = _grid_job(job_dir, number, overrides, None, "failed", None)
    return sorted(jobs.values(), key=lambda j: j.number)


def _grid_job(job_dir: Path, number: int, overrides: list[str], objective: Optional[float], status: str,
              seconds: Optional[float]) -> Job:
    run_file = job_dir / RUN_FILE
    return Job(number, " ".join(overrides), objective, status, seconds,
               run_file.read_text().strip() if run_file.exists() else None,
               dict(o.split("=", 1) for o in overrides if "=" in o))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class RunnerSweepHook(SweepHook):
    def __init__(self, config: DictConfig) -> None:
        super().__init__(config)
        self.parent: ParentRun | None = None
        self.best_so_far: Optional[float] = None
        self.lock = threading.Lock()  # slot threads report trials concurrently through one MLflow client

    def direction(self) -> Any:
        """The study's direction when hydra.sweeper.direction is null: the objective's, resolved for its task."""
        try:
            return sweep_objective(self.config).direction
        except SpecError as e:
            raise SweepConfigError(str(e)) from None

    def preload(self) -> list[str]:
        modules = ["runner.cli.launch", "runner.search.trial", "optuna"]
        if OmegaConf.select(self.config, "tracking.name", default=None) == "mlflow":
            modules += ["mlflow.tracking", "mlflow.entities"]
        return modules

    def trial_overrides(self, storage_url: str, study_name: str, number: int) -> list[str]:
        return [f"trial.storage={_quote(storage_url)}", f"trial.study_name={_quote(study_name)}", f"trial.number={number}"]

    def sweep_started(self, study: Any, d: dict[str, Any]) -> None:
        try:
            self.parent = ParentRun.from_config(self.config)
        except SpecError as e:  # the store cannot be opened: one line, before any trial
            raise SweepConfigError(str(e)) from None
        if self.parent is None:
            return
        self.best_so_far = _best_value(study)
        params = {k: d[k] for k in ("study_name", "storage", "direction", "n_jobs", "pruner")}
        params["sampler"] = f"{d['sampler']}(seed={d['seed']})"
        params.update({f"search_space.{k}": v for k, v in d["search_space"].items()})
        params.update({f"fixed.{k}": v for k, v in d["fixed"].items()})
        tags = {"runner.sweeper": "optuna", "optuna.study_name": d["study_name"], "optuna.sampler": d["sampler"],
                "optuna.pruner": d["pruner"], "optuna.storage": d["storage"], "sweep_dir": d["sweep_dir"],
                "n_trials": str(d["n_trials"])}
        # one parent per study, however many sweep processes start on it at once (the sweeper's claim)
        run_id, made = once_per_study(open_storage(d["storage"]), study.study_name, PARENT_RUN_ATTR,
                                      lambda: self.parent.start(name=d["study_name"], tags=tags, params=params),
                                      usable=lambda run: run_exists(self.parent.client, run))
        if not made:
            self.parent.start(name=d["study_name"], tags=tags, params=params, reuse=run_id)

    def trial_done(self, study: Any, trial: Any, killed: bool) -> None:
        try:
            if self.parent is None or self.parent.run_id is None:
                return
            with self.lock:
                self._tag_child(trial, killed)
                self._log_on_parent(study, trial)
        except Exception as e:  # noqa: BLE001 - MLflow trouble must not end the sweep
            log.warning(f"MLflow: could not record trial {trial.number} ({type(e).__name__}: {e})")
        finally:
            # SIGTERM/SIGHUP that came as this trial's run had finished in this process: the trial is recorded with
            # its value, and the sweep now gets the signal (its handler stops it before the next trial)
            from runner.engine import preemption

            preemption.send_unheard()

    def sweep_finished(self, study: Any, status: str, results: Optional[Path]) -> None:
        jobs = [_job(t) for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
        metric = str(OmegaConf.select(self.config, "objective.metric", default="objective"))
        single = len(study.directions) == 1
        best = best_job(jobs, single and study.direction.name == "MAXIMIZE") if single else None
        sweep_dir, link = Path(str(self.config.hydra.sweep.dir)), None
        if self.parent is not None and self.parent.run_id is not None:
            try:
                with self.lock:
                    self._summarize_on_parent(study, results)
                    log_jobs_table(self.parent.client, self.parent.run_id, jobs, metric, sweep_dir)
                    link = run_link(self.parent.client, self.parent.uri, self.parent.run_id)
            except Exception as e:  # noqa: BLE001
                log.warning(f"MLflow: could not summarize the study on its parent run ({type(e).__name__}: {e})")
            finally:
                self.parent.finish(status)
        print_summary(jobs, best, metric if single else "objective", sweep_dir, link)

    def _tag_child(self, trial: Any, killed: bool) -> None:
        from mlflow.entities import RunTag
        from optuna.trial import TrialState

        run_id = trial_run_id(trial)
        if run_id is None:
            return
        client = self.parent.client
        tags = {"optuna.trial": str(trial.number), "optuna.state": trial.state.name, "optuna.best": "false",
                "optuna.params": json.dumps(trial.params)}
        status = client.get_run(run_id).info.status
        if trial.state == TrialState.FAIL and status in ("RUNNING", "FINISHED"):
            tags["runner.outcome"] = "killed" if killed or status == "RUNNING" else "failed"
        client.log_batch(run_id, tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
        if "runner.outcome" in tags:
            client.set_terminated(run_id, status="KILLED" if tags["runner.outcome"] == "killed" else "FAILED")

    def _log_on_parent(self, study: Any, trial: Any) -> None:
        from mlflow.entities import Metric
        from optuna.study import StudyDirection
        from optuna.trial import TrialState

        if trial.state != TrialState.COMPLETE:
            return
        metrics = [Metric(f"objective_{i}", v, 0, trial.number) for i, v in enumerate(trial.values)]
        if len(study.directions) == 1:
            metrics = [Metric("trial_value", trial.value, 0, trial.number)]
            better = study.direction == StudyDirection.MAXIMIZE
            if self.best_so_far is None or (trial.value > self.best_so_far if better else trial.value < self.best_so_far):
                self.best_so_far = trial.value
            metrics.append(Metric("best_value", self.best_so_far, 0, trial.number))
        self.parent.client.log_batch(self.parent.run_id, metrics=metrics)

    def _summarize_on_parent(self, study: Any, results: Optional[Path]) -> None:
        from mlflow.entities import Metric, RunTag
        from optuna.trial import TrialState

        client, run_id = self.parent.client, self.parent.run_id
        trials = study.get_trials(deepcopy=False)
        single = len(study.directions) == 1
        metrics = [Metric(f"trials_{s.name.lower()}", sum(t.state == s for t in trials), 0, 0)
                   for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)]
        best = [t for t in [_best_trial(study)] if t] if single else study.best_trials
        before = client.get_run(run_id).data.tags.get("best_trial", "")
        tags = [RunTag("best_trial", ",".join(str(t.number) for t in best))]
        if single and best:
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
        if results is not None and results.exists():
            client.log_artifact(run_id, str(results))


def sweep_objective(config: DictConfig) -> Any:
    """The sweep's objective (an ObjectiveSpec) from its composed config, its direction resolved for its task
    as each job's is; a SpecError when it cannot be (an unknown metric, a direction the task contradicts)."""
    from runner.specs.fields import build
    from runner.specs.metric_names import resolved_objective
    from runner.specs.objective import ObjectiveSpec

    node = OmegaConf.to_container(config.objective, resolve=True) if "objective" in config else {}
    if OmegaConf.select(config, "task._target_", default=None) is None:
        # a Hydra app of its own (the sweep hook serves any app): no task declares a direction, its typed one stands
        return build(ObjectiveSpec, {k: v for k, v in node.items() if k in ("metric", "direction")}, "objective.")
    task = OmegaConf.select(config, "task._target_")
    try:
        return resolved_objective(build(ObjectiveSpec, node, "objective."), str(task))
    except SpecError:
        raise
    except (ImportError, AttributeError, ValueError) as e:  # the task cannot be imported: each job says so too
        raise SpecError(f"task._target_: cannot import {task!r} ({type(e).__name__}: {e})") from None


def trial_run_id(trial: Any) -> Optional[str]:
    """The trial's MLflow run: its job wrote the run id into the trial, in the study's storage
    (runner.search.trial), which every sweep process reads wherever the job ran; a trial of an older
    job: its run directory names it, where that directory is on this machine."""
    if trial.system_attrs.get(MLFLOW_RUN_ATTR):
        return str(trial.system_attrs[MLFLOW_RUN_ATTR])
    run_dir = trial.system_attrs.get(RUN_DIR_ATTR)
    run_file = Path(run_dir) / RUN_FILE if run_dir else None
    return run_file.read_text().strip() if run_file is not None and run_file.exists() else None


def _job(trial: Any) -> Job:
    state = trial.state.name.lower()
    seconds = (trial.datetime_complete - trial.datetime_start).total_seconds() \
        if trial.datetime_complete and trial.datetime_start else None
    params = {k: str(v) for k, v in {**trial.params, **trial.user_attrs}.items()
              if isinstance(v, (int, float, str)) and not k.startswith("cv/")}  # cv/*: a k-fold run's results, not overrides
    value = trial.value if state == "complete" and len(trial.values or []) == 1 else None
    return Job(trial.number, " ".join(f"{k}={v}" for k, v in params.items()), value, state, seconds,
               trial_run_id(trial), params)


def _best_trial(study: Any) -> Any:
    try:
        return study.best_trial
    except ValueError:  # no COMPLETE trial yet
        return None


def _best_value(study: Any) -> Optional[float]:
    best = _best_trial(study) if len(study.directions) == 1 else None
    return best.value if best else None


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
