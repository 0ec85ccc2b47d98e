"""torch.compile for the engine: the mode trainer.compile names, one graph for every batch size, and
which optimizer steps compiled, so their time is reported apart from the throughput.

A ragged last batch (and an evaluation split's, and a rank's two-sample stand-in for an empty share)
must not recompile the model. The batch dimension of every input is marked dynamic before each call
(`torch._dynamo.maybe_mark_dynamic`), so the first compile already makes one graph for any batch size.
Padding the batch instead would change what a BatchNorm sees and a model's own loss; dropping it would
change the data. `maybe_` rather than `mark_dynamic`: a model whose code fixes the batch size is compiled
for it (and recompiled for a ragged batch) instead of failing. A batch of exactly one sample is still
compiled once more (torch specialises sizes 0 and 1); that step is then timed apart like any compile.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

log = logging.getLogger(__name__)

MODES = (False, True, "default", "reduce-overhead", "max-autotune")  # the values trainer.compile takes
BACKEND = "inductor"  # torch's own; tests of the recompile rules swap in "eager" (same guards, no code generation)


def compile_model(model: torch.nn.Module, mode: bool | str, device: torch.device) -> torch.nn.Module:
    """The model compiled in `mode` (False: as it is; True: "default")."""
    if mode is False:
        return model
    if mode == "reduce-overhead" and device.type != "cuda":
        log.warning("trainer.compile=reduce-overhead: CUDA graphs need a GPU; on %s it compiles as default",
                    device.type)
    return torch.compile(model, mode=None if mode in (True, "default") else mode, backend=BACKEND)


def dynamic_batch(inputs: Any, labels: Any = None) -> None:
    """Marks dimension 0 of every tensor the model is called with as a batch of any size (before the call)."""
    for value in (*(inputs.values() if isinstance(inputs, dict) else (inputs,)), labels):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(value, 0)


class _Compilations:
    """Counts, in this process, every compilation torch starts: a traced frame, a backward graph
    compiled at its first use, a CUDA graph recording."""

    def __init__(self) -> None:
        self.started = 0

    def watch(self) -> "_Compilations":
        """Registered again where it is missing: torch._dynamo.reset() clears every callback."""
        handler = getattr(getattr(torch, "_dynamo", None), "callback_handler", None)
        if handler is not None and self._start not in handler.start_callbacks:
            handler.register_start_callback(self._start)
        return self

    def _start(self, _args: Any) -> None:
        self.started += 1


_COMPILATIONS = _Compilations()


class CompileClock:
    """Which optimizer steps compiled and how long they took. Such a step (the first, a recompile, a CUDA
    graph recording) is timed apart: its seconds and units leave the throughput window. Any compilation
    counts, also one of a model that compiles parts of itself with trainer.compile=false."""

    def __init__(self) -> None:
        self.events = _COMPILATIONS.watch()
        self.seconds = 0.0             # wall time of the steps that compiled, this process
        self.steps: list[int] = []     # which steps those were
        self._start, self._seen = 0.0, 0

    def step_starts(self) -> None:
        self._start, self._seen = time.perf_counter(), self.events.started

    def step_ended(self, step: int) -> float | None:
        """The step's seconds when it compiled, else None."""
        if self.events.started == self._seen:
            return None
        seconds = time.perf_counter() - self._start
        self.seconds += seconds
        self.steps.append(step)
        return seconds

    def summary(self) -> str | None:
        if not self.steps:
            return None
        shown = ", ".join(map(str, self.steps[:5])) + (", ..." if len(self.steps) > 5 else "")
        return (f"compile: {self.seconds:.1f} s in {len(self.steps)} step(s) that compiled (step {shown}); "
                "not counted in throughput")
