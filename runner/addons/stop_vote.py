"""The stop vote: every rank stops at the same step after any rank got SIGTERM or SIGHUP
(runner/engine/preemption.py notes the signal; this add-on decides the step)."""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from runner.addons.base import AddOn, Stop
from runner.engine import preemption


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
        signum = self.agreed() if self.distributed else preemption.pending_signal()  # one process: no vote
        return Stop(f"stopped by {signal.Signals(signum).name}", signal=signum) if signum else None

    def agreed(self) -> int:
        """The signal number that stops the run at this step boundary, or 0 (on vote boundaries a
        collective on every rank). The vote is a CPU tensor: the process group's gloo side carries it
        (runner.engine.parallel gives a CUDA group `cpu:gloo` too), so a GPU never waits for it."""
        if not self.distributed:
            return preemption.pending_signal()
        self.calls += 1
        if self.calls < self.next_vote:
            return 0
        now = time.perf_counter()
        vote = torch.tensor([float(preemption.pending_signal()), now - self.voted_time], dtype=torch.float64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        signum, seconds = int(vote[0]), float(vote[1])
        per_step = seconds / (self.calls - self.voted_at)
        self.next_vote = self.calls + min(max(int(self.every_s / max(per_step, 1e-9)), 1), self.max_steps)
        self.voted_at, self.voted_time = self.calls, now
        return signum
