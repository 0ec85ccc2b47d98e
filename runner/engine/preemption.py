"""SIGTERM and SIGHUP: what `docker stop`, SLURM's preemption and a closed terminal send.

Python's default for both is to die on the spot, leaving the MLflow run RUNNING and the steps since
the last checkpoint lost. Instead, while a run trains, a signal is noted and the run stops at the next
step boundary: every rank agrees on that step (a tiny all-reduce on the CPU, at steps all ranks know
in advance, about twice a second: see runner/addons/stop_vote.py), the checkpoint of that step is written, the MLflow run ends KILLED, and the process exits with the conventional 128 + signal number. A requeued job (`trainer.resume=<run dir>`)
or an elastic restart then goes on from that step. A signal that comes while the run is not in its
step loop (building data, the final evaluation) stops it at once, as Ctrl-C does.

A second signal while stopping changes nothing: a closed terminal sends SIGHUP to the launcher and to
its workers, and the launcher forwards its own. SIGKILL, which follows when the grace period ends,
leaves the previous checkpoint.

Inside a SLURM job the stop also requeues the job (`scontrol requeue $SLURM_JOB_ID`, as Lightning's
auto-requeue does; `trainer.slurm_requeue=false` turns it off): SLURM ends a job that exits on its own
after a preemption's or a time limit's SIGTERM (143) without requeueing it, so the job asks for it
itself, once its step's checkpoint is written and its MLflow run ended KILLED. The requeued job reruns
its command into the same run directory and continues from that step (runner/cli/run_lock.requeued).

A signal after the run ended FINISHED (trained, tested, its final checkpoint written) stops nothing of the run and
requeues nothing: the run stays FINISHED and the process exits 0. A sweep that ran it in its own process (one
slot) is stopped by it once it has recorded that trial, before its next one (the signal used to be forgotten, and
the sweep ran every trial it had left); a run around it (k-fold's, PBT's) stops as if it came then.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from typing import Iterator

# shared with the sweep's own stop: runner's run stop and launcher take a dropped stop again the same way
from hydra_plugins.runner_optuna_sweeper.dropped import raised_again_when_dropped


log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_state = {"signal": 0, "deferred": False, "finished": False, "unheard": 0}


class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal (a KeyboardInterrupt, so whatever ends a Ctrl-C'd run KILLED ends it)."""

    def __init__(self, signum: int, step: int | None = None, run_dir: str | None = None):
        self.signum, self.step = signum, step
        self.exit_code = 128 + signum
        where = f" at step {step}" if step is not None else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{where}")
        if run_dir is not None:  # the step loop stopped it, with that step's checkpoint written
            log.warning("%s: stopped at step %d and wrote its checkpoint; trainer.resume=%s continues the run",
                        signal.Signals(signum).name, step, run_dir)


def _on_signal(signum: int, frame: object) -> None:
    if _state["signal"]:
        return  # already stopping
    _state["signal"] = signum
    if _state["finished"]:
        log.warning("%s after the run finished: it stays FINISHED, nothing to stop", signal.Signals(signum).name)
        return
    if not _state["deferred"]:
        raise Stopped(signum)


def signalled() -> int:
    """The stop signal this process got (0: none); the ranks agree on it only through StopVote."""
    return _state["signal"]


def run_finished() -> None:
    """The run ended FINISHED: a signal from here on stops nothing (no KILLED, no exit 143, no requeue)."""
    _state["finished"] = True


@contextlib.contextmanager
def handled(requeue: bool = False) -> Iterator[None]:
    """SIGTERM and SIGHUP stop the run inside cleanly; the previous handlers come back after. Signal
    handlers belong to the main thread: elsewhere (a sweep's trial thread) nothing changes. `requeue`:
    a run they stop inside a SLURM job requeues the job (the caller knows the job is this run's own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _state["signal"], _state["finished"], _state["unheard"] = 0, False, 0
    requeued = False
    try:
        with raised_again_when_dropped(_dropped_stop):
            yield
    except Stopped as e:
        if requeue:
            e.requeued_job = requeued = requeue_slurm_job()
        raise
    finally:
        for s, handler in previous.items():
            # a requeued job's process is leaving: SLURM's own SIGTERM for the requeue must not cut its exit short
            signal.signal(s, signal.SIG_IGN if requeued else handler)
        after_finish = _state["signal"] if _state["finished"] else 0
        _state["signal"], _state["deferred"], _state["finished"] = 0, False, False
        # The run stays FINISHED, but the signal was meant for the process too. A run around this one (k-fold's,
        # PBT's) stops as if it came now; a sweep's handler gets it once the sweep has recorded this trial
        # (send_unheard). Without either (a single run: Python's default handler) the process exits 0.
        if after_finish and previous.get(after_finish) is _on_signal:
            _on_signal(after_finish, None)
        elif after_finish and callable(previous.get(after_finish)):
            _state["unheard"] = after_finish


def send_unheard() -> None:
    """The stop signal that came after a run in this process had finished, sent again to this process, now that
    the handler around the run is back: a sweep's hook calls this once the sweep has recorded the trial (a
    finished trial keeps its value), and the sweep stops before its next trial."""
    signum, _state["unheard"] = _state["unheard"], 0
    if signum:
        os.kill(os.getpid(), signum)


def _dropped_stop(e: BaseException) -> int:
    """The signal of a run's Stopped raised by its handler (not the step loop's), made not "already stopping" so
    that the signal sent again raises again."""
    if isinstance(e, Stopped) and e.step is None and _state["signal"] == e.signum:
        _state["signal"] = 0
        return e.signum
    return 0


def requeue_slurm_job() -> str:
    """`scontrol requeue $SLURM_JOB_ID` from the job's first process (global rank 0 of its first task);
    the job's id when it is requeued (by this call, or already by SLURM's own preemption), else ''."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job or os.environ.get("RANK", "0") != "0" or os.environ.get("SLURM_PROCID", "0") != "0":
        return ""
    # said before the call: the requeue ends this job's processes at once, and a line after it lost that race when
    # the machine was busy (the job requeued and went on, its log without a word of why)
    log.warning("SLURM job %s requeues itself: it continues this run from its checkpoint when it runs again "
                "(trainer.slurm_requeue=false turns this off)", job)
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
        reason = out.stderr.strip().splitlines()[-1] if out.returncode and out.stderr.strip() else f"exit {out.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        out, reason = None, str(e)
    if out is not None and (out.returncode == 0 or "pending" in reason.lower()):  # pending: SLURM requeued it already
        return job
    log.warning("SLURM job %s could not requeue itself after all (scontrol requeue: %s); submit it again with the same "
                "hydra.run.dir, or continue with trainer.resume=<run dir>", job, reason)
    return ""


@contextlib.contextmanager
def at_step_boundaries() -> Iterator[None]:
    """Inside, a signal is only noted: the step loop asks the stop vote (runner/addons/stop_vote.py) at each step boundary."""
    _state["deferred"] = True
    try:
        yield
    finally:
        _state["deferred"] = False


def pending_signal() -> int:
    """The stop signal this process got while its run trains (0: none): StopVote (runner/addons/stop_vote.py)
    asks it at step boundaries."""
    return _state["signal"]
