"""A run that runs out of memory ends in one line saying so and what to change, not a traceback: the CPU
allocator's failure (torch's "DefaultCPUAllocator: can't allocate memory", Python's MemoryError) or CUDA's
(torch.OutOfMemoryError), wherever the run was (building the model, its first step, a checkpoint)."""
from __future__ import annotations

import re

from runner.specs.run import RunSpec

_CPU_FAILURE = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def out_of_memory_line(error: BaseException, spec: RunSpec) -> str | None:
    """The line for `error` when it is an allocation that failed; None for any other error."""
    text = str(error)
    cpu = _CPU_FAILURE.search(text)
    if cpu is not None:
        what = f"could not allocate {_size(int(cpu.group(1)))} more on the CPU"
    elif type(error).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA), without importing torch here
        tried = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
        what = f"could not allocate {tried.group(1)} more on the GPU" if tried else "could not allocate on the GPU"
    elif isinstance(error, MemoryError):
        what = "could not allocate more on the CPU"
    else:
        return None
    par = spec.parallelism
    if par.dp_shard > 1:
        fix = (f"shard over more processes (parallelism.nproc_per_node above {par.nproc_per_node * par.nnodes}), "
               "or parallelism.cpu_offload=true")
    else:
        fix = ("use parallelism=fsdp parallelism.nproc_per_node=N to shard the parameters, gradients and optimizer "
               "state over N processes")
    return (f"out of memory: {what}; the model's training state and activations do not fit this process's memory: "
            f"{fix}, or a smaller dataset.batch_size")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
