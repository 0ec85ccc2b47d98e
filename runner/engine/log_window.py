"""The training metrics of one logging window: the steps since the last logged step.

The window keeps each step's loss sum (a device tensor: no sync per step), unit count and FLOPs, and
the seconds spent training. Evaluation and checkpoint writing run inside `paused()`, so throughput
counts training time only; a step that compiled or was profiled is `exclude`d from it (its loss still
counts), and the profiler opens and closes its window `paused()`. The
window is part of a checkpoint (every rank's own), so a resumed run logs exactly the values the
uninterrupted run logs, whatever step the checkpoint was written at.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch


class LogWindow:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.counts: list[int | torch.Tensor] = []  # a tensor where the labels sit on an accelerator
        self.seconds = 0.0         # training time of the window before `_since`
        self.untimed = 0           # units of steps whose time is not throughput (they compiled)
        self.flops = 0.0           # this rank's FLOPs of the window's steps (runner/engine/flops.py)
        self.untimed_flops = 0.0   # of those, the steps that compiled
        self._since: float | None = time.perf_counter()  # None while paused

    def add(self, loss_sum: torch.Tensor, count: int | torch.Tensor, flops: float = 0.0) -> None:
        self.losses.append(loss_sum)
        self.counts.append(count)
        self.flops += flops

    def exclude(self, seconds: float, count: int | torch.Tensor, flops: float = 0.0) -> None:
        """A step of `count` units and `flops` that took `seconds` (it compiled, or was profiled) leaves the
        throughput, not the loss."""
        self.seconds -= seconds
        self.untimed += count
        self.untimed_flops += flops

    def start(self) -> None:
        """Training starts (or goes on after a resume) now: the set-up before it is not training time."""
        self._since = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count as training time."""
        self.seconds = self.elapsed()
        self._since = None
        try:
            yield
        finally:
            self._since = time.perf_counter()

    def close(self, reduce_sum: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None,
              device: torch.device) -> tuple[float, int, float, int, float]:
        """The window's loss sum and unit count over all ranks, its training seconds, and the units and
        FLOPs those seconds timed (all ranks; less the steps that compiled or were profiled); a new window
        starts. `reduce_sum` None: one process, whose sums are read as they are."""
        loss = torch.stack(self.losses).sum()
        total = sum(self.counts)
        if reduce_sum is None:
            loss, count, timed, flops = loss.item(), int(total), int(total - self.untimed), self.flops - self.untimed_flops
        else:
            flops = torch.tensor(self.flops - self.untimed_flops, dtype=torch.float64, device=device)
            loss, count, timed, flops = reduce_sum([loss, *torch.tensor([float(total), float(total - self.untimed)],
                                                                        device=device), flops])
            loss, count, timed, flops = loss.item(), int(count.item()), int(timed.item()), float(flops.item())
        seconds = self.elapsed()
        self.losses, self.counts, self.seconds, self.untimed, self._since = [], [], 0.0, 0, time.perf_counter()
        self.flops = self.untimed_flops = 0.0
        return loss, count, seconds, timed, flops

    def elapsed(self) -> float:
        """The window's training seconds so far."""
        return self.seconds + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def state_dict(self) -> dict:
        """This rank's window so far; the losses as they are, so that their sum comes out bit for bit."""
        return {"losses": [t.detach().cpu() for t in self.losses], "counts": [int(c) for c in self.counts],
                "seconds": self.elapsed(), "untimed": int(self.untimed), "flops": float(self.flops),
                "untimed_flops": float(self.untimed_flops)}

    def load_state_dict(self, states: list[dict], rank: int, world: int, device: torch.device) -> None:
        """Every rank's saved window (none in a checkpoint from before windows were saved). Resumed on
        as many ranks, each takes its own; on another number, rank 0 takes them all (the same sums)."""
        mine = [states[rank]] if len(states) == world else states if rank == 0 else []
        self.losses = [t.to(device) for state in mine for t in state["losses"]]
        self.counts = [int(c) for state in mine for c in state["counts"]]
        self.seconds, self._since = max((float(s["seconds"]) for s in mine), default=0.0), time.perf_counter()
        self.untimed = sum(int(s.get("untimed", 0)) for s in mine)
        self.flops = sum(float(s.get("flops", 0.0)) for s in mine)
        self.untimed_flops = sum(float(s.get("untimed_flops", 0.0)) for s in mine)
