"""The study loop: ask a trial whenever a slot is free, launch its job, tell the outcome.

- Slots refill as soon as any trial ends: no batch barrier (hydra-optuna-sweeper waits for a batch).
- n_trials counts every trial of the study, so a resumed study stops at n_trials in total and several
  sweep processes sharing a storage and study run n_trials together. A retry replaces the trial it
  retries; a trial asked past the budget by a racing process is marked `runner.surplus`, failed at
  once and not counted.
- A trial that raises, diverges or returns NaN is FAIL: the console gets one line, its job log the
  traceback. The sweep goes on until more than max_failure_rate x n_trials have failed (0.0, the
  default: the first failure stops it), and exits non-zero when every trial it ran failed. A pruned
  job raises optuna.TrialPruned: PRUNED.
- Heartbeats: the sweep writes each running trial's heartbeat into the storage; a trial whose sweep
  died stops beating and the next sweep on the study fails it (and retries it, max_retry).
Which study, and the sampler's seed: _study.py. What is left behind: _results.py, and whatever the
app's hook records (hook.py; runner's: an MLflow parent run with a child run per trial).
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import optuna
from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from . import _bookkeeping as books
from . import _compose_cache, _slots, _stopping, _workers
from ._builders import build_pruner, build_sampler, check_sampler, pruner_config
from ._checks import check_settings, custom_search_space
from ._results import write_results
from ._search_space import describe, distribution_from_config, grid_values, parse_params, suggest
from ._study import open_study, seed_for
from .hook import load_hook
from .storage import PRUNER_ATTR

log = logging.getLogger(__name__)


_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


class SweepFailed(RuntimeError):
    """The sweep stopped on failed trials (one line; each trial's traceback is in its job log)."""

    exit_code = 1


@dataclass
class SweeperSettings:
    sampler: Any
    pruner: Any
    direction: Any
    storage: Optional[str]
    study_name: Optional[str]
    n_trials: int
    n_jobs: int
    max_failure_rate: float
    params: Optional[DictConfig]
    search_space: Optional[DictConfig]
    custom_search_space: Optional[str]
    heartbeat_interval: Optional[int]
    grace_period: Optional[int]
    max_retry: int


class OptunaSweeperImpl(Sweeper):
    def __init__(self, settings: SweeperSettings) -> None:
        self.s = settings
        self.custom: Optional[Callable[[DictConfig, optuna.Trial], None]] = None
        self.mine: set[int] = set()  # trial numbers this process is running
        self.first_beat: dict[int, float] = {}  # other sweeps' running trials: their heartbeat when first seen
        self.last_error: Optional[str] = None  # "trial N: <one line>" of the last failed trial
        self.ran: dict[int, TrialState] = {}  # trials this process ran, and how they ended
        self.pruner_name: Optional[str] = None  # the configured pruner, None when it is NopPruner
        self.warned_unreported = False
        self.stop = _stopping.StopSignals(raise_now=False, send_on=False)  # sweep() installs the real ones

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.hook = load_hook(task_function, config)  # the app's extras, declared by its task function
        self.launcher = Plugins.instance().instantiate_launcher(config=config, hydra_context=hydra_context,
                                                                task_function=task_function)
        if not isinstance(self.launcher, BasicLauncher) and callable(getattr(self.launcher, "task_function", None)):
            # jobs in the launcher's processes: an interrupted one is its trial's outcome (_slots.JobInterrupted)
            self.launcher.task_function = _slots.InterruptsAsErrors(self.launcher.task_function)

    # --- the sweep ---------------------------------------------------------------------------

    def sweep(self, arguments: list[str]) -> None:
        # from the start: a stop signal while the study opens is kept for the study loop, which ends the study's
        # books and the parent run KILLED (before, it killed the sweep process on the spot)
        here = isinstance(self.launcher, BasicLauncher)
        self.stop = _stopping.StopSignals(raise_now=False, send_on=not here)
        with self.stop.installed():
            self._sweep(arguments, here)

    def _sweep(self, arguments: list[str], here: bool) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.directions = self._directions()
        check_settings(self.s, self.directions)  # before anything is made: no study, no parent run
        check_sampler(self.s.sampler)
        self.custom = custom_search_space(self.s.custom_search_space)
        self.space, self.fixed, self.deletions = self._search_space(arguments)
        pruner_cfg = pruner_config(self.s.pruner, self.config)
        name = pruner_cfg["_target_"].split(".")[-1]
        self.pruner_name = None if name == "NopPruner" else name
        grid = {k: grid_values(k, d) for k, d in self.space.items()} if self._is_grid() else None
        self.n_jobs = self._slot_count()
        self.spawn = self.n_jobs > 1 and isinstance(self.launcher, BasicLauncher)
        _compose_cache.install(self.launcher)  # trials that pick the same config groups share one composition
        self.workers = _workers.SlotProcesses(self.launcher, self.n_jobs, self._preload()[1:]) if self.spawn else None
        if self.spawn and not self.workers.start():  # forked: the fork server starts only to replace one
            _slots.set_preload(self._preload())  # its imports overlap the study's and MLflow's setup
            _slots.warm_up()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        opened = open_study(self.s.storage, self.s.study_name, sweep_dir, self.directions, self.space,
                            build_pruner(pruner_cfg))
        self.study, self.storage_url = opened.study, opened.storage_url
        self.storage = opened.storage
        self.study.set_user_attr(PRUNER_ATTR, pruner_cfg)
        seed, seed_note = seed_for(OmegaConf.select(self.s.sampler, "seed", default=None), opened.created)
        self.study.sampler = build_sampler(self.s.sampler, grid, seed)
        existing = len(self.study.get_trials(deepcopy=False))
        self.n_trials = min(self.s.n_trials, math.prod(len(v) for v in grid.values())) if grid else self.s.n_trials
        log.info(f"Study name: {self.study.study_name}  ({'new' if opened.created else f'resumed, {existing} trials already'}"
                 f", {self.n_trials} in total)")
        log.info(f"Storage: {self.storage_url}")
        log.info(f"Sampler: {type(self.study.sampler).__name__} ({seed_note})  Pruner: {pruner_cfg['_target_'].split('.')[-1]}")
        log.info(f"Directions: {self.directions}  Slots: {self.n_jobs}")
        done = sum(t.state in _FINISHED for t in books.counted(self.study.get_trials(deepcopy=False)))
        if done >= self.n_trials:
            log.warning(f"the study already has {done} finished trials of n_trials={self.n_trials}: nothing left to run "
                        "(raise hydra.sweeper.n_trials to run more, or use another study)")
        pruner_args = ", ".join(f"{k}={v}" for k, v in pruner_cfg.items() if k != "_target_")
        self.hook.sweep_started(self.study, {
            "study_name": self.study.study_name, "storage": self.storage_url, "sampler": type(self.study.sampler).__name__,
            "seed": seed, "pruner": f"{pruner_cfg['_target_'].split('.')[-1]}({pruner_args})",
            "direction": ",".join(d.lower() for d in self.directions), "n_jobs": self.s.n_jobs,
            "n_trials": self.s.n_trials, "sweep_dir": str(sweep_dir),
            "search_space": {k: describe(d) for k, d in self.space.items()}, "fixed": dict(self.fixed)})
        self.stop.raise_now = here and not self.spawn  # trials in this process: stopped as by Ctrl-C
        status = "FAILED"
        try:
            self._run()
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self.stop.raise_now = False  # a second signal must not cut the books short
            results = write_results(self.study, self.storage_url, sweep_dir)
            self.hook.sweep_finished(self.study, status, results)

    def _run(self) -> None:
        free = list(range(self.n_jobs))
        running: dict[Future, int] = {}
        pool = ThreadPoolExecutor(self.n_jobs, thread_name_prefix="slot") if self.n_jobs > 1 else None
        try:
            while True:
                self.stop.check()
                if self.s.heartbeat_interval:
                    books.fail_stale_trials(self.study, self.storage, self.mine,
                                            self.s.grace_period or 2 * self.s.heartbeat_interval, self.s.max_retry,
                                            on_failed=lambda t: self.hook.trial_done(self.study, t, killed=True))
                stop = self._too_many_failures()
                while free and not stop and not self.stop.signum and (trial := self._next_trial()) is not None:
                    slot = free.pop(0)
                    overrides = self._draw(trial)  # here, in trial-number order: a seed fixes each trial's params
                    if pool is None:
                        self._run_trial(trial, slot, overrides)
                        free.append(slot)
                        stop = self._too_many_failures()
                    else:
                        running[pool.submit(self._run_trial, trial, slot, overrides)] = slot
                if running:
                    for future in self._first_done(running):
                        free.append(running.pop(future))
                        future.result()
                elif not stop and self._others_running():
                    time.sleep(self._poll_s())  # a peer's trial may still end, or go stale and be retried
                else:
                    break
        except KeyboardInterrupt:
            _slots.terminate_all()
            while self.stop.signum and self.stop.send_on and not all(f.done() for f in running):
                self.stop.send_to_children()  # the launcher's processes, those started meanwhile too
                wait(list(running), timeout=0.5)
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            if self.workers is not None:
                self.workers.close()
        if self._too_many_failures():
            raise SweepFailed(f"{self._failed()} of this sweep's trials failed, more than max_failure_rate="
                              f"{self.s.max_failure_rate} x n_trials={self.n_trials} allows (raise "
                              f"hydra.sweeper.max_failure_rate to go on past failures); last: {self.last_error}")
        if self.ran and all(state == TrialState.FAIL for state in self.ran.values()):
            raise SweepFailed(f"all {len(self.ran)} trials this sweep ran failed; last: {self.last_error}")

    def _first_done(self, running: dict[Future, int]) -> set[Future]:
        """The trials that ended within a poll (or none), back at once when a stop signal comes."""
        deadline = time.monotonic() + self._poll_s()
        done: set[Future] = set()
        while not done and not self.stop.signum and (left := deadline - time.monotonic()) > 0:
            done, _ = wait(list(running), timeout=min(left, 0.5), return_when=FIRST_COMPLETED)
        return done

    def _next_trial(self) -> Optional[optuna.Trial]:
        trials = self.study.get_trials(deepcopy=False)
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if not waiting and len(books.counted(trials)) >= self.n_trials:
            return None
        trial = self.study.ask()
        if books.over_budget(self.study, self.storage.get_trial(trial._trial_id), self.n_trials):
            self.storage.set_trial_system_attr(trial._trial_id, books.SURPLUS, True)
            self._tell(trial, TrialState.FAIL, None)
            return None
        return trial

    def _draw(self, trial: optuna.Trial) -> list[str] | Exception:
        """The trial's overrides, its params sampled now, in the sweep's thread: slot threads sampling at
        once would take the sampler's random numbers in whatever order they ran. What stops them from
        being drawn fails the trial in _run_trial, as if its job had raised it."""
        try:
            return self._overrides(trial)
        except Exception as e:  # noqa: BLE001
            return e

    def _run_trial(self, trial: optuna.Trial, slot: int, overrides: list[str] | Exception) -> None:
        self.mine.add(trial.number)
        state, values, killed = TrialState.FAIL, None, False
        try:
            with books.heartbeat(self.storage, trial._trial_id, self.s.heartbeat_interval):
                if isinstance(overrides, Exception):
                    raise overrides
                if self.stop.signum:  # handed out as the sweep was stopped: it would start after the signal went
                    raise _slots.JobInterrupted("not started: the sweep is stopping")
                # the hook's overrides reach the job but not its "#N : ..." line: that shows what the user swept
                internal = self.hook.trial_overrides(self.storage_url, self.study.study_name, trial.number)
                if self.workers is not None:  # a slot's process runs trial after trial
                    value = self.workers.launch(overrides + internal, trial.number, slot, hidden=internal)
                else:
                    value = _slots.launch(self.launcher, overrides + internal, trial.number, hidden=internal)
                values = self._values(trial, value)
                state = TrialState.COMPLETE
        except optuna.TrialPruned:
            state = TrialState.PRUNED
        except KeyboardInterrupt:
            killed = True
            raise
        except _slots.JobInterrupted as e:  # stopped in a launcher's process: killed, as on Ctrl-C in this one
            killed = True
            log.warning(f"trial {trial.number}: {e}")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a failed trial must not end the sweep
            killed = isinstance(e, _slots.JobDied) and e.killed or bool(self.stop.signum)
            if self.stop.signum:  # its process ended by the signal sent on (joblib: a worker still starting)
                log.warning(f"trial {trial.number}: stopped with the sweep ({type(e).__name__})")
            else:
                where = f" (traceback in {e.job_log})" if getattr(e, "job_log", None) else ""
                first_line = (str(e).strip().splitlines() or [""])[0]
                self.last_error = f"trial {trial.number}: {type(e).__name__}: {first_line}{where}"
                log.warning(f"{self.last_error.replace(':', ' failed:', 1)}")
        finally:
            self._tell(trial, state, values)
            self.ran[trial.number] = state
            frozen = self.storage.get_trial(trial._trial_id)
            self._warn_if_unreported(frozen)
            self.hook.trial_done(self.study, frozen, killed=killed)
            if killed:
                books.retry(self.study, frozen, self.s.max_retry)
            self.mine.discard(trial.number)

    def _warn_if_unreported(self, trial: optuna.trial.FrozenTrial) -> None:
        """A pruner can stop only trials that report: a job that completes without one report (a plain
        Hydra app) makes the pruner do nothing, which is said once per sweep rather than left silent."""
        if (self.pruner_name and not self.warned_unreported and trial.state == TrialState.COMPLETE
                and not trial.intermediate_values and len(self.directions) == 1):
            self.warned_unreported = True
            log.warning(f"the pruner ({self.pruner_name}) prunes nothing in this sweep: trial {trial.number} completed "
                        "without reporting a value; a job must call trial.report(value, step) and raise "
                        "optuna.TrialPruned when trial.should_prune() (sweeper/README.md, Configuration), else use "
                        "hydra/sweeper/pruner=none")

    # --- trials --------------------------------------------------------------------------------

    def _overrides(self, trial: optuna.Trial) -> list[str]:
        for name, distribution in self.space.items():
            suggest(trial, name, distribution)
        for name, value in self.fixed.items():
            trial.set_user_attr(name, value)
        if self.custom is not None:
            self.custom(self.config, trial)
        overlap = trial.params.keys() & self.fixed.keys()
        if overlap:
            raise ValueError(f"parameters both fixed and searched: {sorted(overlap)}")
        return [f"{name}={value}" for name, value in {**trial.params, **self.fixed}.items()] + self.deletions

    def _values(self, trial: optuna.Trial, value: Any) -> list[float]:
        try:
            values = [float(value)] if len(self.directions) == 1 else [float(v) for v in value]
        except (TypeError, ValueError):
            raise ValueError(f"the job must return {'a number' if len(self.directions) == 1 else 'a list of numbers'}, got {value!r}") from None
        if len(values) != len(self.directions):
            raise ValueError(f"the job returned {len(values)} values for {len(self.directions)} objectives")
        if any(math.isnan(v) for v in values):
            raise ValueError(f"the job returned NaN ({value!r})")
        return values

    def _tell(self, trial: optuna.Trial, state: TrialState, values: Optional[list[float]]) -> None:
        try:
            self.study.tell(trial, values if state == TrialState.COMPLETE else None, state=state)
        except optuna.exceptions.UpdateFinishedTrialError:
            log.warning(f"trial {trial.number} was already finished (failed as stale by another sweep?)")
        except RuntimeError as e:  # the grid sampler calls study.stop() once the grid is done
            if "Study.stop" not in str(e):
                raise

    def _others_running(self) -> bool:
        """Whether another sweep's running trial has not beaten since this sweep first saw it: it may
        be dead, so wait until it beats (alive: its own sweep finishes it) or goes stale (retry it)."""
        if not self.s.heartbeat_interval:  # without heartbeats a dead peer's trial would be waited on forever
            return False
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            beat = t.system_attrs.get(books.HEARTBEAT, 0.0)
            if t.number not in self.mine and self.first_beat.setdefault(t.number, beat) == beat:
                return True
        return False

    def _failed(self) -> int:
        """Failed trials this process ran (as hydra-optuna-sweeper counts the failures of its own
        jobs): a resumed study's old failures, or trials of a killed sweep failed here as stale,
        do not stop a new sweep; a trial replaced by its retry does not count."""
        trials = books.counted(self.study.get_trials(deepcopy=False))
        return sum(1 for t in trials if t.state == TrialState.FAIL and t.number in self.ran)

    def _too_many_failures(self) -> bool:
        return self._failed() > self.s.max_failure_rate * self.n_trials

    def _poll_s(self) -> float:
        return min(5.0, float(self.s.heartbeat_interval or 5))

    # --- configuration ---------------------------------------------------------------------------

    def _search_space(self, arguments: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str], list[str]]:
        params = [f"{k}={v}" for k, v in (self.s.params or {}).items()]
        space, fixed, deletions = parse_params(params + list(arguments),
                                               ["hydra.sweeper.params."] * len(params) + [""] * len(arguments))
        if self.s.search_space is not None and self.s.params is not None:  # warned as hydra-optuna-sweeper warns
            warnings.warn("Both hydra.sweeper.params and hydra.sweeper.search_space are configured: hydra.sweeper.params "
                          "defines the search space and search_space is ignored", UserWarning, stacklevel=2)
        elif self.s.search_space is not None:  # hydra-optuna-sweeper 1.1's form, under the overrides
            warnings.warn("`hydra.sweeper.search_space` is deprecated and will be removed in the next major release: "
                          "write the search space as hydra.sweeper.params (Hydra's override grammar)", UserWarning,
                          stacklevel=2)
            old = {str(k): distribution_from_config(v) for k, v in self.s.search_space.items() if str(k) not in fixed}
            space = {**old, **space}
        return space, fixed, deletions

    def _directions(self) -> list[str]:
        d = self.s.direction  # unset: the app's hook says (runner: objective.direction); else minimize, as there
        if d is None:
            d = self.hook.direction() or "minimize"
        directions = list(d) if isinstance(d, (list, tuple)) or OmegaConf.is_list(d) else [d]
        return [str(x.name if hasattr(x, "name") else x).lower() for x in directions]

    def _is_grid(self) -> bool:
        return str(OmegaConf.select(self.s.sampler, "_target_", default="")).endswith("GridSampler")

    def _preload(self) -> list[str]:
        """What jobs import, for the fork server to import once: the app's own script, and what its
        hook names (runner's: the engine, Optuna, and MLflow when they track)."""
        return ["__main__", *self.hook.preload()]

    def _slot_count(self) -> int:
        if self.s.n_jobs > 0:
            return self.s.n_jobs
        import os

        return max(1, len(_slots.visible_gpus()) or os.cpu_count() or 1)
