"""Achieved TFLOP/s and model FLOPs utilisation (MFU).

The FLOPs of each micro-step (forward and backward) are those of the batch it trained on, counted by
torch.utils.flop_counter on a meta twin of the model (its structure, every parameter and buffer a meta
tensor; made before any wrap, activation checkpointing or compile, so the count is the model's own and
not the recomputation's) with a meta batch of that shape: the count is that of the real model (frozen
parameters get no weight gradient, the first layer no input gradient), and no weight, statistic,
gradient or random stream of the run is touched. It counts matmuls, convolutions and attention (the
counter's registered ops), not elementwise work, as MFU conventionally does (PaLM, torchtitan).

A count is kept per sample for each batch shape past the batch dimension (a padded text batch's own
length) and each set of trainable parameters (gradual unfreezing adds weight gradients mid-run), so
the counter runs once per new shape, outside the timed training seconds. A window's FLOPs are the sum
of its micro-steps' over all ranks, whatever the accumulation, ragged batches or world size; a stand-in
for a rank's empty share trains nothing and counts 0.

MFU divides the achieved TFLOP/s of one device by its dense peak at the run's precision: from
`trainer.peak_tflops` when set, else from the table of known GPUs below. On a CPU or an unknown GPU
only TFLOP/s is logged.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from runner.specs.run import RunSpec

log = logging.getLogger(__name__)
_requires_grad = operator.attrgetter("requires_grad")

# Dense (no sparsity) peak TFLOP/s per device from the vendors' datasheets, by the precision the
# matmuls run in. fp32 is plain fp32: torch does not use TF32 for matmuls unless precision=tf32.
# First match of the name (torch.cuda.get_device_name) wins: the more specific patterns come first.
_HOPPER = {"fp8": 1978.9, "bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H100.*PCIe", {"fp8": 1513.0, "bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100.*NVL|H200.*NVL", {"fp8": 1670.5, "bf16": 835.2, "fp16": 835.2, "tf32": 417.6, "fp32": 60.0}),
    (r"H100|H200|GH200", _HOPPER),  # SXM; GH200 has the same GPU
    (r"B200", {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"fp8": 733.0, "bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"L40\b", {"fp8": 362.1, "bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"RTX A6000", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    (r"RTX 4090", {"fp8": 330.3, "bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),  # fp32 accumulate
    (r"RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    (r"V100.*PCIE", {"fp16": 112.0, "fp32": 14.0}),  # Volta: no bf16, no tf32
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
]
# runner's precision options (conf/precision) by the number format their matmuls run in
MATMUL_FORMAT = {"fp32": "fp32", "tf32": "tf32", "fp16": "fp16", "bf16": "bf16", "bf16_true": "bf16", "fp8": "fp8"}


def table_peak(device_name: str, precision: str) -> float | None:
    """The table's dense peak TFLOP/s of the named GPU at a precision option; None when not listed."""
    number_format = MATMUL_FORMAT.get(precision)
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return peaks.get(number_format) if number_format else None
    return None


def device_peak(override: float | None, precision: str, device: torch.device) -> float | None:
    """One device's peak TFLOP/s: trainer.peak_tflops when set, else the table's for this GPU (None on a CPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = table_peak(name, precision)
    if peak is None:
        log.info("no peak TFLOP/s known for %s at precision=%s: MFU is not logged; set trainer.peak_tflops", name, precision)
    return peak


def micro_step_flops(module: torch.nn.Module, inputs: Any, labels: Any, batch_size: int, pass_labels: bool) -> int:
    """FLOPs of one training forward and backward of `module` on a micro-batch of `batch_size` samples
    shaped like `inputs` (the batch dimension first), counted on meta tensors."""
    from torch.utils.flop_counter import FlopCounterMode

    def meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (batch_size, *t.shape[1:]) if t.dim() else ()
        return torch.empty(shape, dtype=t.dtype, device="meta")

    state = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
    state.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()})
    kwargs = {"labels": meta(labels)} if pass_labels else {}
    args: tuple = ()
    if isinstance(inputs, dict):
        kwargs.update({k: meta(v) for k, v in inputs.items()})
    else:
        args = (meta(inputs),)
    with FlopCounterMode(display=False) as counter:
        output = torch.func.functional_call(module, state, args, kwargs)
        # any scalar of the outputs backpropagates through the same matmuls as the task's loss
        outs = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
        if outs:
            torch.stack([t.float().sum() for t in outs]).sum().backward()
    return counter.get_total_flops()


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in _tensors(v)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in _tensors(v)]
    return [t for t in (getattr(output, "logits", None), getattr(output, "loss", None)) if isinstance(t, torch.Tensor)]


class FlopCount:
    """The FLOPs of the micro-batches a run trains on, counted on a meta twin of `module` once per batch
    shape (past the batch dimension) and set of trainable parameters, read from `params`: the module's
    parameters, in their order (a wrap that replaces them, FSDP's, sets the new ones here)."""

    def __init__(self, module: torch.nn.Module, pass_labels: bool):
        self.module, self.pass_labels = module, pass_labels
        self.params = list(module.parameters())  # a list: walking the module per micro-batch would cost more
        self.per_sample: dict[tuple, float] = {}
        self.failed = False
        try:
            self.twin = meta_twin(module)
        except Exception as e:  # a module that cannot be copied: no count, the run goes on
            self._give_up(e)

    def of(self, batch: Any, counting: Callable[[], Any] = contextlib.nullcontext) -> float | None:
        """FLOPs of one training micro-step on `batch` (a tasks.Batch on the device, prepared); None where the
        model cannot be counted. A shape not seen before is counted inside `counting()` (the engine pauses
        its training clock there)."""
        if self.failed:
            return None
        inputs = batch.inputs
        trainable = tuple(map(_requires_grad, self.params))
        if type(inputs) is torch.Tensor and inputs.dim() and not self.pass_labels:  # the usual batch: one key, no walk
            samples, key = inputs.shape[0], (trainable, inputs.shape[1:])
        else:
            tensors = [t for t in _tensors(inputs) if t.dim()]
            if not tensors:
                return None
            samples = tensors[0].shape[0]
            labels = _tensors(batch.labels) if self.pass_labels else []
            key = (trainable, *(t.shape[1:] for t in tensors), *(t.shape[1:] for t in labels))
        per_sample = self.per_sample.get(key)
        if per_sample is None:
            with counting():
                for twin, real in zip(self.twin.parameters(), self.params):
                    twin.requires_grad_(real.requires_grad)
                try:
                    flops = micro_step_flops(self.twin, batch.inputs, batch.labels, samples, self.pass_labels)
                except Exception as e:  # any op without a meta kernel, any value read: counting is a report, not the run
                    self._give_up(e)
                    return None
            per_sample = self.per_sample[key] = flops / samples
        return per_sample * samples

    def _give_up(self, e: Exception) -> None:
        self.failed = True
        log.warning("FLOPs of %s could not be counted on meta tensors (%s): no TFLOP/s or MFU logged",
                    type(self.module).__name__, str(e).splitlines()[0] if str(e) else type(e).__name__)


def meta_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers are meta tensors (no memory, nothing of the real
    weights copied): the structure the FLOP counter runs, whatever wraps the real module later."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


@dataclass(frozen=True)
class FlopRate:
    """Turns a window's FLOPs (all ranks) and seconds into TFLOP/s per device and MFU."""

    peak_tflops: float | None     # one device's; None: no MFU
    world: int = 1

    def metrics(self, flops: float, seconds: float) -> dict[str, float]:
        if seconds <= 0 or flops <= 0:  # no FLOPs: the model could not be counted
            return {}
        tflops = flops / seconds / self.world / 1e12
        out = {"throughput/tflops": tflops}
        if self.peak_tflops:
            out["throughput/mfu"] = tflops / self.peak_tflops
        return out


def measure(module: torch.nn.Module, stand_in: Any, spec: "RunSpec", device: torch.device,
            pass_labels: bool, world: int) -> tuple[FlopCount, FlopRate]:
    """The run's FlopCount, which counts the stand-in's shape now (a model the counter cannot run on meta
    tensors, one reading its inputs' values say, is told before training and logs no TFLOP/s; the run
    goes on), and its FlopRate."""
    count = FlopCount(module, pass_labels)
    count.of(stand_in)
    return count, FlopRate(device_peak(spec.trainer.peak_tflops, spec.precision.name, device), world)
