"""Opening the MLflow store on a thread while torch and the engine build.

Before its first step a tracked run spends seconds on MLflow: importing it, opening the store (a fresh
sqlite file is created and migrated), ending the store's orphaned runs and finding the experiment.
None of it depends on the model or the data, so `open_in_background` starts it as soon as the spec is
known, and the tracker takes the result with `opened` when training starts: it waits for the thread
and raises the thread's error there (the same one-line SpecError it would raise opening the store
itself). The MLflow run is still created by the tracker at that point, as before: a run whose engine
fails to build leaves no run behind, RUNNING or otherwise.
"""
from __future__ import annotations

import threading
from typing import Any

from runner.mlflow_store import open_client, open_experiment
from runner.spec import TrackingSpec

_Key = tuple[str, str, str]  # uri, experiment, artifact_root


class _Opening(threading.Thread):
    def __init__(self, key: _Key) -> None:
        # not a daemon: a process that ends meanwhile waits for it rather than cutting a migration short
        super().__init__(name="runner-mlflow-open")
        self.key = key
        self.result: tuple[Any, str] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = _open(*self.key)
        except BaseException as e:  # noqa: BLE001  (handed to the thread that waits for it)
            self.error = e


_openings: dict[_Key, _Opening] = {}
_guard = threading.Lock()


def _key(tracking: TrackingSpec) -> _Key:
    return tracking.uri, tracking.experiment, tracking.artifact_root


def _open(uri: str, experiment: str, artifact_root: str) -> tuple[Any, str]:
    client = open_client(uri)
    return client, open_experiment(client, experiment, uri, artifact_root)


def open_in_background(tracking: TrackingSpec) -> None:
    """Start opening tracking's store and experiment on a thread (once per store and experiment)."""
    if tracking.name == "none":
        return
    with _guard:
        if _key(tracking) in _openings:
            return
        opening = _openings[_key(tracking)] = _Opening(_key(tracking))
    opening.start()


def opened(uri: str, experiment: str, artifact_root: str) -> tuple[Any, str]:
    """An MlflowClient on uri and the experiment's id: what open_in_background's thread made for this
    store and experiment (waiting for it, raising its error), else opened now."""
    with _guard:
        opening = _openings.pop((uri, experiment, artifact_root), None)
    if opening is None:
        return _open(uri, experiment, artifact_root)
    opening.join()
    if opening.error is not None:
        raise opening.error
    assert opening.result is not None
    return opening.result
