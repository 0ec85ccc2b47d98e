"""SIGTERM and SIGHUP: what `docker stop`, SLURM's preemption and a closed terminal send.

Python's default for both is to die on the spot, leaving the MLflow run RUNNING and the steps since
the last checkpoint lost. Instead, while a run trains, a signal is noted and the run stops at the next
step boundary: every rank agrees on that step (one tiny all-reduce per step, on the CPU), the
checkpoint of that step is written, the MLflow run ends KILLED, and the process exits with the conventional 128 + signal number. A requeued job (`trainer.resume=<run dir>`)
or an elastic restart then goes on from that step. A signal that comes while the run is not in its
step loop (building data, the final evaluation) stops it at once, as Ctrl-C does.

A second signal while stopping changes nothing: a closed terminal sends SIGHUP to the launcher and to
its workers, and the launcher forwards its own. SIGKILL, which follows when the grace period ends,
leaves the previous checkpoint.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_state = {"signal": 0, "deferred": False}


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
    if not _state["deferred"]:
        raise Stopped(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGTERM and SIGHUP stop the run inside cleanly; the previous handlers come back after. Signal
    handlers belong to the main thread: elsewhere (a sweep's trial thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _state["signal"] = 0
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state["signal"], _state["deferred"] = 0, False


@contextlib.contextmanager
def at_step_boundaries() -> Iterator[None]:
    """Inside, a signal is only noted: the step loop asks `StopVote.agreed()` at each step boundary."""
    _state["deferred"] = True
    try:
        yield
    finally:
        _state["deferred"] = False


class StopVote:
    """Whether any rank got a stop signal, decided by all ranks at the same step."""

    def __init__(self, distributed: bool):
        self.distributed = distributed

    def agreed(self) -> int:
        """The signal number that stops the run at this step boundary, or 0 (a collective on every rank).
        The vote is a CPU tensor: the process group's gloo side carries it (runner.parallel gives a CUDA
        group `cpu:gloo` too), so a GPU never waits for it."""
        if not self.distributed:
            return _state["signal"]
        vote = torch.tensor([_state["signal"]], dtype=torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        return int(vote.item())
