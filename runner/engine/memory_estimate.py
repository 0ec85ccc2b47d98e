"""Before training (`trainer.memory_estimate`): one line per device of what training will hold there,
parameters, gradients, optimizer state and activations, against what the device has, and what to
change when it will not fit.

- parameters and gradients: this rank's own tensors (its shards under fsdp), in their dtypes;
- averaged weights (trainer.ema, trainer.swa): each average is a copy of this rank's parameters and
  persistent buffers beside the model, floats of less than 32 bits kept in fp32 (runner/addons/averaging.py);
- optimizer state: computed from the optimizer's type and settings (its state is created at the first
  step; tests check the figures against the state after one step);
- activations: measured on one micro-step of a real batch, as the memory its forward pass keeps for
  the backward pass (on CUDA torch.cuda.memory_allocated; on the CPU glibc's count of bytes in use,
  mallinfo2, which also sees what checkpointed blocks keep). The micro-step leaves no trace: the
  gradients are dropped, BatchNorm statistics and every random stream are put back. Under pipeline
  parallelism no micro-step runs the stages outside the schedule: the line says activations are not measured.
- per rank under every dimension: the figures are this rank's own tensors, so dp_shard's shards, tp's
  split layers and pp's stages on this rank are what is counted.
- what the device has: free CUDA memory plus what this process already holds; on the CPU the
  machine's available RAM (/proc/meminfo), or what a data limit (RLIMIT_DATA) leaves if less, plus what
  this process's tensors already use.
"""
from __future__ import annotations

import ctypes
import logging
import math
import resource
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from runner.engine import parallel
from runner.engine.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

MiB = 2 ** 20

# state tensors the size of a parameter that each optimizer keeps, by class name (group settings below)
_ADAM_LIKE = {"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Lamb", "LambC", "AdaBelief", "Lion"}


@dataclass
class Figures:
    rank: int
    device: str
    parameters: int
    gradients: int
    optimizer: int | None     # None: an optimizer whose state size is not known here
    optimizer_name: str
    activations: int | None   # None: not measured
    micro_batch: int
    available: int | None     # None: unknown
    averages: int = 0         # the EMA/SWA copies of the weights; 0: no averaging
    unmeasured: str = ""      # why the activations were not measured, as the line says it ("" or " (...)")

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + (self.optimizer or 0) + (self.activations or 0) + self.averages

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def line(self) -> str:
        optimizer = _mib(self.optimizer) if self.optimizer is not None else f"unknown for {self.optimizer_name}"
        activations = (f"{_mib(self.activations)} (measured, one micro-batch of {self.micro_batch})"
                       if self.activations is not None else f"not measured{self.unmeasured}")
        has = f"{_mib(self.available)} available" if self.available is not None else "unknown available memory"
        verdict = "fits" if self.fits else "WILL NOT FIT"
        averages = f", averaged weights {_mib(self.averages)}" if self.averages else ""
        return (f"memory on rank {self.rank} ({self.device}): parameters {_mib(self.parameters)}, gradients "
                f"{_mib(self.gradients)}, optimizer state {optimizer}{averages}, activations {activations}; total "
                f"{_mib(self.total)} of {has}: {verdict}")

    def tags(self) -> dict[str, str]:
        """MLflow tags, not metrics: a measurement of the machine, which a run resumed in place measures
        anew (a tag is replaced; a metric would add points to the history that equals an uninterrupted run's)."""
        values = {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                  "activations": self.activations, "averages": self.averages or None, "total": self.total,
                  "available": self.available}
        return {f"memory.{k}_mib": f"{v / MiB:.3f}" for k, v in values.items() if v is not None}


def advice(figures: Figures, spec) -> str:
    """What to change, biggest lever first, leaving out what the run already does."""
    tips = []
    if figures.activations and figures.activations > figures.total / 4:
        batch = spec.dataset.batch_size
        if batch > 1:
            tips.append(f"dataset.batch_size={batch // 2} +accum={spec.accumulation.steps * 2} (the same global batch)")
        if spec.trainer.activation_checkpointing != "full":
            tips.append("trainer.activation_checkpointing=" + ("full" if spec.trainer.activation_checkpointing ==
                                                                "selective" else "selective or full"))
    if spec.precision.name in ("fp32", "tf32"):
        tips.append("precision=bf16")
    if spec.parallelism.dp_shard == 1:  # nothing sharded yet (fsdp and hsdp shard)
        tips.append("parallelism=fsdp (shards parameters, gradients and optimizer state)")
    elif not spec.parallelism.cpu_offload:
        tips.append("parallelism.cpu_offload=true")
    return "to make it fit, try: " + "; ".join(tips) if tips else "no memory option left to try: a larger device"


def report(spec, module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, env, tracker,
           loader, loss_of: Callable | None) -> Figures:
    """Every rank measures its own figures (`module`: this rank's part of the model, its own shards); the main
    rank logs one line per rank (and the advice when one will not fit), and its own figures to MLflow as tags.
    `loss_of(raw_batch)` is one micro-batch's loss; None where no micro-step can run outside the step (pp)."""
    micro_step, unmeasured = None, ""
    if loss_of is not None:
        state = loader.generator.get_state() if loader.generator is not None else None
        raw = next(iter(loader))
        if state is not None:  # the loader's own seed stream, as if this batch had never been drawn
            loader.generator.set_state(state)
        micro_step = lambda: loss_of(raw)  # noqa: E731
    elif spec.parallelism.pp > 1:
        unmeasured = " (under parallelism.pp the schedule runs the micro-batches through the stages)"
    copies = (spec.trainer.ema.decay is not None) + (spec.trainer.swa.start_epoch is not None)
    figures = estimate(module, optimizer, device, env.rank, micro_step, spec.dataset.batch_size, copies)
    figures.unmeasured = unmeasured
    everyone = parallel.gather_objects(figures)
    if env.is_main:
        for one in everyone:
            log.info("%s", one.line())
        short = [one for one in everyone if not one.fits]
        if short:
            log.warning("%s", advice(max(short, key=lambda f: f.total), spec))
        tracker.set_tags(figures.tags())
    return figures


def estimate(module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, rank: int,
             micro_step: Callable[[], torch.Tensor] | None, micro_batch: int, averaged_copies: int = 0) -> Figures:
    """This rank's figures; `micro_step` returns one micro-batch's loss (its forward pass), None: not measured;
    `averaged_copies`: how many averages of the weights (EMA, SWA) the run keeps."""
    # what fsdp's cpu_offload keeps on the CPU does not count against a GPU
    params = [p for p in map(parallel.local_tensor_of, module.parameters()) if p.device.type == device.type]
    trainable = [p for p in map(parallel.local_tensor_of, module.parameters()) if p.requires_grad
                 and p.device.type == device.type]
    activations = measure_activations(module, micro_step, device) if micro_step is not None else None
    return Figures(rank, str(device), _bytes(params), _bytes(trainable), optimizer_state_bytes(optimizer, device.type),
                   type(optimizer).__name__, activations, micro_batch, available_bytes(device),
                   averaged_copies * averaged_weights_bytes(module, device.type))


def averaged_weights_bytes(module: nn.Module, device_type: str) -> int:
    """Bytes of one average of `module`'s weights as runner/addons/averaging.py keeps it: this rank's
    parameters and persistent buffers (tied ones once), floats below 32 bits in fp32."""
    persistent = set(module.state_dict(keep_vars=True))
    tensors = dict(module.named_parameters())
    tensors.update((name, b) for name, b in module.named_buffers() if name in persistent)
    total = 0
    for t in map(parallel.local_tensor_of, tensors.values()):
        if t.device.type == device_type:
            total += t.numel() * (4 if t.is_floating_point() and t.element_size() < 4 else t.element_size())
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, device_type: str | None = None) -> int | None:
    """Bytes of the per-parameter state `optimizer` will keep (on `device_type`: beside its parameter),
    from its type and group settings."""
    name, total = type(optimizer).__name__, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            p = parallel.local_tensor_of(p)
            if device_type is not None and p.device.type != device_type:
                continue
            if name in _ADAM_LIKE:
                per = 1 if name == "Lion" else 3 if group.get("amsgrad") else 2
            elif name == "SGD":
                per = 1 if group.get("momentum") else 0
            elif name == "RMSprop":
                per = 1 + bool(group.get("momentum")) + bool(group.get("centered"))
            elif name == "Adagrad":
                per = 1
            elif name == "Adadelta":
                per = 2
            elif name in ("Muon", "AdaMuon"):  # momentum for orthogonalised matrices; AdamW's two for the rest
                per = 2 if group.get("use_fallback") or p.ndim < 2 else 1
            elif name == "Adafactor":  # factored second moment for matrices: a row and a column vector
                total += (p.shape[-2] + p.shape[-1]) * p.element_size() if p.ndim >= 2 else p.numel() * p.element_size()
                continue
            else:
                return None
            total += per * p.numel() * p.element_size()
    return total


def measure_activations(module: nn.Module, micro_step: Callable[[], torch.Tensor], device: torch.device) -> int | None:
    """Memory the forward pass of one micro-step keeps for its backward pass; runs the backward too (under
    ddp/fsdp every rank must join its collectives), then leaves no trace (gradients, statistics, RNG)."""
    if held_bytes(device) is None:
        return None
    buffers = [(b, b.clone()) for b in module.buffers()]
    grads = [p.grad for p in module.parameters()]
    rng = rng_state()
    # The math libraries allocate their workspaces at a process's first product of a shape and keep them (MKL's
    # buffers on the CPU: 8 MiB at a first 64x64 matmul; cuBLAS's workspace on CUDA) so measured cold, a run's
    # activations held them too: 16.7 MiB for the default run first in a process, 0.1 MiB for it after another
    # (issue 35). One forward pass without autograd first allocates them; then the measured pass counts only
    # what autograd keeps, whatever ran before in the process.
    with torch.no_grad():
        micro_step()
    set_rng_state(rng)
    before = held_bytes(device)
    loss = micro_step()
    kept = held_bytes(device) - before
    loss.backward()
    del loss
    with torch.no_grad():
        for buffer, value in buffers:
            buffer.copy_(value)
    for p, grad in zip(module.parameters(), grads):
        p.grad = grad
    set_rng_state(rng)
    return max(kept, 0)


def held_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    info = _mallinfo()
    return None if info is None else info.uordblks + info.hblkhd


def available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return min(kib * 1024, _data_limit_left()) + (held_bytes(device) or 0)


def _data_limit_left() -> float:
    """What this process may still allocate under its data limit (RLIMIT_DATA: `ulimit -d`, prlimit), or inf."""
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    if soft == resource.RLIM_INFINITY:
        return math.inf
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) for line in f if line.startswith("VmData:")) * 1024
    except (OSError, StopIteration, ValueError):
        return math.inf
    return max(soft - used, 0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo() -> _MallInfo2 | None:
    """glibc's allocator statistics (the CPU has no torch memory counter); None on another C library."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return libc.mallinfo2()


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _mib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / MiB:.1f} MiB"
