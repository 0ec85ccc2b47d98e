"""The study's books, kept in its storage so every sweep process sharing it reads the same:
the trial budget, running trials' heartbeats, stale (killed) trials and their retries.

- Budget: n_trials counts every trial of the study, but a retry replaces the trial it retries, and a
  trial asked past the budget by a racing sweep process is marked SURPLUS, failed at once, not counted.
- Heartbeats: the sweep running a trial stamps HEARTBEAT (wall-clock seconds) into its system attrs
  every interval; any storage works (Optuna's own heartbeats exist only for RDB storages). A trial
  silent for the grace period had its sweep killed: it is failed, and retried when configured.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

log = logging.getLogger(__name__)
HEARTBEAT = "runner.heartbeat"
SURPLUS = "runner.surplus"


def replaced(trials: list[FrozenTrial]) -> set[int]:
    """Trials that a retry has taken the place of."""
    return {t.system_attrs["retry_history"][-1] for t in trials if t.system_attrs.get("retry_history")}


def counted(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that use the budget: neither replaced by a retry nor surplus."""
    gone = replaced(trials)
    return [t for t in trials if t.number not in gone and not t.system_attrs.get(SURPLUS)]


def is_enqueued(trial: FrozenTrial) -> bool:
    """A retry or an enqueued trial: it already holds its place in the budget."""
    return "failed_trial" in trial.system_attrs or "fixed_params" in trial.system_attrs


def over_budget(study: optuna.Study, trial: FrozenTrial, n_trials: int) -> bool:
    """Whether a freshly asked trial is one past n_trials (another sweep took the last place)."""
    return not is_enqueued(trial) and len(counted([t for t in study.get_trials(deepcopy=False) if t.number <= trial.number])) > n_trials


def retry(study: optuna.Study, trial: FrozenTrial, max_retry: int) -> None:
    """Queue the trial again with the same params, at most max_retry times in its retry history."""
    if max_retry > 0:
        optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)(study, trial)


@contextmanager
def heartbeat(storage: BaseStorage, trial_id: int, interval: int | None) -> Iterator[None]:
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.set_trial_system_attr(trial_id, HEARTBEAT, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:
                return
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{trial_id}")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fail_stale_trials(study: optuna.Study, storage: BaseStorage, mine: set[int], grace: float, max_retry: int,
                      on_failed: Callable[[FrozenTrial], None]) -> None:
    """FAIL (and retry) every running trial of another sweep that stopped beating `grace` seconds
    ago; `on_failed` gets each (the report ends its MLflow run KILLED)."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        last = max(t.system_attrs.get(HEARTBEAT, 0.0), t.datetime_start.timestamp())  # a retry inherits old beats
        if t.number in mine or time.time() - last <= grace:
            continue
        try:
            if storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                log.warning(f"trial {t.number} stopped beating {time.time() - last:.0f} s ago (its sweep was "
                            f"killed): FAIL{', retried' if max_retry else ''}")
                failed = storage.get_trial(t._trial_id)
                on_failed(failed)
                retry(study, failed, max_retry)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another sweep process got there first
