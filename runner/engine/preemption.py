"""SIGTERM and SIGHUP: what `docker stop`, SLURM's preemption and a closed terminal send.

Python's default for both is to die on the spot, leaving the MLflow run RUNNING and the steps since
the last checkpoint lost. Instead, while a run trains, a signal is noted and the run stops at the next
step boundary: every rank agrees on that step (a tiny all-reduce on the CPU, at steps all ranks know
in advance, about twice a second: see StopVote), the checkpoint of that step is written, the MLflow run ends KILLED, and the process exits with the conventional 128 + signal number. A requeued job (`trainer.resume=<run dir>`)
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

A signal after the run ended FINISHED (trained, tested, its final checkpoint written) stops nothing and
requeues nothing: the run stays FINISHED and the process exits 0.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Iterator

import torch
import torch.distributed as dist

from runner.addons.base import AddOn
from runner.engine.stopping import Stop

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_state = {"signal": 0, "deferred": False, "finished": False}


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
    _state["signal"], _state["finished"] = 0, False
    requeued = False
    try:
        yield
    except Stopped as e:
        if requeue:
            e.requeued_job = requeued = requeue_slurm_job()
        raise
    finally:
        for s, handler in previous.items():
            # a requeued job's process is leaving: SLURM's own SIGTERM for the requeue must not cut its exit short
            signal.signal(s, signal.SIG_IGN if requeued else handler)
        _state["signal"], _state["deferred"], _state["finished"] = 0, False, False


def requeue_slurm_job() -> str:
    """`scontrol requeue $SLURM_JOB_ID` from the job's first process (global rank 0 of its first task);
    the job's id when it is requeued (by this call, or already by SLURM's own preemption), else ''."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job or os.environ.get("RANK", "0") != "0" or os.environ.get("SLURM_PROCID", "0") != "0":
        return ""
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
        reason = out.stderr.strip().splitlines()[-1] if out.returncode and out.stderr.strip() else f"exit {out.returncode}"
    except (OSError, subprocess.TimeoutExpired) as e:
        out, reason = None, str(e)
    if out is not None and (out.returncode == 0 or "pending" in reason.lower()):  # pending: SLURM requeued it already
        log.warning("SLURM job %s requeued: it continues this run from its checkpoint when it runs again "
                    "(trainer.slurm_requeue=false turns this off)", job)
        return job
    log.warning("SLURM job %s could not requeue itself (scontrol requeue: %s); submit it again with the same "
                "hydra.run.dir, or continue with trainer.resume=<run dir>", job, reason)
    return ""


@contextlib.contextmanager
def at_step_boundaries() -> Iterator[None]:
    """Inside, a signal is only noted: the step loop asks `StopVote.agreed()` at each step boundary."""
    _state["deferred"] = True
    try:
        yield
    finally:
        _state["deferred"] = False


class StopVote(AddOn):
    """Whether any rank got a stop signal, decided by all ranks at the same step (an add-on: asked at
    every step's end, it returns a Stop carrying the signal; the engine writes that step's checkpoint).

    Under ddp/fsdp the vote is a collective: one network round trip (far more than a small step takes
    across nodes). So ranks vote only at steps they all know in advance: each vote also takes the
    slowest rank's seconds per step since the previous vote, and the next vote comes after about
    `every_s` seconds of such steps (1 to `max_steps` steps later). The interval is computed from
    reduced values only, so it is the same on every rank; a signal stops the run within about
    `every_s` seconds plus one step, well inside a preemption's grace period."""

    name = "stop_vote"

    def __init__(self, distributed: bool, every_s: float = 0.5, max_steps: int = 100):
        self.distributed, self.every_s, self.max_steps = distributed, every_s, max_steps
        self.calls = 0        # step boundaries seen (one call each)
        self.next_vote = 1    # the boundary of the next vote: the first one votes
        self.voted_at, self.voted_time = 0, time.perf_counter()

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> Stop | None:
        signum = self.agreed()
        return Stop(f"stopped by {signal.Signals(signum).name}", signal=signum) if signum else None

    def agreed(self) -> int:
        """The signal number that stops the run at this step boundary, or 0 (on vote boundaries a
        collective on every rank). The vote is a CPU tensor: the process group's gloo side carries it
        (runner.engine.parallel gives a CUDA group `cpu:gloo` too), so a GPU never waits for it."""
        if not self.distributed:
            return _state["signal"]
        self.calls += 1
        if self.calls < self.next_vote:
            return 0
        now = time.perf_counter()
        vote = torch.tensor([float(_state["signal"]), now - self.voted_time], dtype=torch.float64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        signum, seconds = int(vote[0]), float(vote[1])
        per_step = seconds / (self.calls - self.voted_at)
        self.next_vote = self.calls + min(max(int(self.every_s / max(per_step, 1e-9)), 1), self.max_steps)
        self.voted_at, self.voted_time = self.calls, now
        return signum
