"""torch.compile for the engine: the mode trainer.compile names, no recompile for a batch of another
size, and which optimizer steps compiled, so their time is reported apart from the throughput.

A ragged last batch (of the training split, of an evaluation split, a rank's two-sample stand-in for
an empty share) must not recompile the model. Such a batch, one whose first dimension is not the
configured micro-batch, runs the same model uncompiled (`for_batch`): the compiled graph keeps static
shapes (kernels specialised to the size, one CUDA graph for reduce-overhead, max-autotune tuned for the
real size), and the odd batch, one an epoch, costs one eager step. The alternatives cost more: a batch
dimension marked dynamic makes every step run code compiled for any size; padding changes what a
BatchNorm sees and a model's own loss; dropping the batch changes the data. A sequence length that
varies from batch to batch still recompiles once, after which torch keeps that dimension dynamic.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runner.specs.run import RunSpec

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


# The task's loss compiled beside the model, on a GPU: language modelling's cross-entropy upcasts the bf16
# logits (batch x length x vocab: 1.6 GB for the GPT-2 124M shape at batch 16) to fp32 and runs a
# log-softmax over them; eager, that writes and reads the fp32 copy several times in forward and backward.
# Compiled, one fused kernel reads the bf16 logits. On a CPU the extra C++ compile costs more than it saves.
# A module flag (like BACKEND) so that `make bench-gpu` can time the engine with the loss left eager.
COMPILE_LOSS = True


class CompiledLoss:
    """`task` with its loss_sum compiled (mode default: a CUDA graph of its own for reduce-overhead would
    hand the backward a buffer the next replay overwrites); everything else is the task's own."""

    def __init__(self, task: Any) -> None:
        self._task = task
        self.loss_sum = torch.compile(task.loss_sum, backend=BACKEND)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def compile_loss(task: Any, spec: "RunSpec", device: torch.device) -> Any | None:
    """The task with its loss compiled, where that pays (trainer.compile on a GPU), else None. Not under
    tensor or context parallelism: their logits are sharded DTensors whose loss runs in torch's own
    loss_parallel context."""
    par = spec.parallelism
    if (not COMPILE_LOSS or spec.trainer.compile is False or device.type != "cuda"
            or par.tp != 1 or par.cp != 1 or par.pp != 1):
        return None
    return CompiledLoss(task)


def for_batch(model: torch.nn.Module, inputs: Any, spec: "RunSpec") -> torch.nn.Module:
    """The compiled model for a full micro-batch (dataset.batch_size samples); the same model uncompiled
    (the same parameters) for a batch of any other size, so that it compiles nothing new."""
    original = getattr(model, "_orig_mod", None)  # what torch.compile wrapped
    if original is None:
        return model
    first = next(iter(inputs.values())) if isinstance(inputs, dict) and inputs else inputs
    if not isinstance(first, torch.Tensor) or not first.dim():
        return model
    full = spec.dataset.batch_size
    # precision=fp8 pads a batch of class labels to a multiple of 16 rows (runner/engine/precision.py)
    padded = -(-full // 16) * 16 if spec.precision.name == "fp8" else full
    return model if first.shape[0] in (full, padded) else original


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
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the step's own kernels belong to it, not to the next, timed step
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
