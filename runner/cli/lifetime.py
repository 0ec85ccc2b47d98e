"""No process of a run outlives the process that started it.

A launcher killed outright (SIGKILL, an OOM kill, a closed container) runs no handler, so its children must
notice by themselves: torchrun's workers, a PBT member, would otherwise train on, write checkpoints and keep
their MLflow run RUNNING with nobody to read their result. Each such child watches its parent: once the parent
is gone (the child was re-parented), it stops as a signalled run does (SIGTERM: the step's checkpoint, the
MLflow run KILLED), and if that has not ended it within a grace period (a collective waiting on a peer that
is gone), it is killed; its tracking process then ends the MLflow run KILLED (runner/tracking/store_process.py).

A thread that polls the parent's pid rather than Linux's PR_SET_PDEATHSIG: that signal follows the thread that
started the child, and the children here are started from pool threads (PBT) as well as main threads.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "RUNNER_LAUNCHER_PID"  # the launcher's pid, for its workers (set before they are started)
GRACE_S = 30.0  # SIGTERM to SIGKILL: a preemption's grace period is about as long


def end_with_parent(parent: int | None = None, grace_s: float = GRACE_S, every_s: float = 0.25) -> threading.Thread:
    """Watch `parent` (default: this process's parent now): once it is gone, SIGTERM to this process, and
    SIGKILL after `grace_s` seconds if it still runs. A parent already gone when this is called counts."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        log.warning("runner: the process that started this one (pid %d) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def launcher_pid() -> int | None:
    """The pid of the runner launcher that started this worker's agent, where one did."""
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    return int(value) if value.isdigit() else None
