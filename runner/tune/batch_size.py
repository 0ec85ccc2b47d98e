"""The batch-size finder (`tune=batch_size`): the largest micro-batch that fits the device, and the
throughput knee, the smallest micro-batch within tune.knee_tolerance of the best samples/s.

The micro-batch doubles from 2 while it fits (on a GPU until out of memory or tune.max_batch_size; on a
CPU, where running out of memory is not an error one can recover from, until throughput stops rising),
then a binary search between the last fit and the first failure. Each candidate runs one untimed and
tune.steps_per_candidate timed optimizer steps (more, up to 10x, while they take under 0.2 s) of the
engine's own train_step; a candidate's rate is its median step's. Under pp the pipeline cuts each candidate's
batch into its micro-batches (not the configured batch's rows), so a candidate runs at its own size. Out of memory is caught,
the candidate's tensors dropped (gradients, partial optimizer state) and the cache emptied before the
next. Under ddp/fsdp the probe steps hold back the gradient all-reduce (as accumulation's micro-steps
do), so one rank running out does not leave the others waiting in a collective; every rank then takes
the same verdict (a failure anywhere is a failure) and the slowest rank's time.
"""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from runner.engine import parallel
from runner.specs.run import RunSpec, SpecError
from runner.specs.tune import TuneSpec
from runner.tune.probing import free_memory, probing, step_batches

log = logging.getLogger(__name__)

START = 2  # a BatchNorm in training refuses a batch of one
MIN_SECONDS = 0.2  # a candidate takes enough timed steps (up to 10x tune.steps_per_candidate) to last this long


@dataclass
class BatchSearch:
    throughput: dict[int, float] = field(default_factory=dict)  # micro-batch -> samples/s, all ranks together
    too_big: set[int] = field(default_factory=set)             # micro-batches that ran out of memory
    cap: int = 0                                                # the largest micro-batch the search could try
    stopped: str = ""

    @property
    def largest_fit(self) -> int:
        return max(self.throughput)


def search(probe: Callable[[int], float | None], cap: int, tolerance: float, until_oom: bool) -> BatchSearch:
    """`probe(b)`: samples/s at micro-batch b, None when it does not fit. Doubling, then a binary search."""
    found = BatchSearch(cap=cap)
    batch, flat = min(START, cap), 0
    while True:
        rate = probe(batch)
        if rate is None:
            found.too_big.add(batch)
            found.stopped = f"out of memory at {batch}"
            break
        best_before = max(found.throughput.values(), default=0.0)
        found.throughput[batch] = rate
        flat = flat + 1 if rate <= best_before * (1 + tolerance) else 0
        if not until_oom and flat >= 2:
            found.stopped = f"throughput stopped rising (twice no more than {tolerance:.0%} over the best)"
            return found
        if batch >= cap:
            found.stopped = f"reached the cap of {cap}"
            return found
        batch = min(2 * batch, cap)
    if not found.throughput:
        raise SpecError(f"tune: even a micro-batch of {batch} does not fit in memory; use a smaller model, "
                        "precision=bf16, or more devices with parallelism=fsdp")
    low, high = found.largest_fit, batch
    while high - low > 1:
        middle = (low + high) // 2
        rate = probe(middle)
        if rate is None:
            found.too_big.add(middle)
            high = middle
        else:
            found.throughput[middle] = rate
            low = middle
    return found


def knee(throughput: dict[int, float], tolerance: float) -> int:
    """The smallest micro-batch whose samples/s is within `tolerance` of the best."""
    best = max(throughput.values())
    return min(b for b, rate in throughput.items() if rate >= (1 - tolerance) * best)


def keep_global(batch: int, spec: RunSpec) -> tuple[int, int]:
    """(micro-batch, accumulation steps) keeping dataset.batch_size x accumulation.steps (x ranks, unchanged):
    the largest divisor of that product not above `batch`."""
    per_rank = spec.dataset.batch_size * spec.accumulation.steps
    micro = max(d for d in range(1, min(batch, per_rank) + 1) if per_rank % d == 0)
    return micro, per_rank // micro


def answer(spec: RunSpec, found: BatchSearch, tune: TuneSpec, dp_degree: int) -> tuple[RunSpec, list[str]]:
    """The spec to train with and the report's lines."""
    chosen = knee(found.throughput, tune.knee_tolerance) if tune.pick == "knee" else found.largest_fit
    dataset, accumulation = spec.dataset, spec.accumulation
    batch, accum = chosen, accumulation.steps
    lines = []
    if tune.keep_global_batch:
        batch, accum = keep_global(chosen, spec)
        lines.append(f"  keeping the global batch of {dataset.batch_size * accumulation.steps * dp_degree} "
                     f"(batch x accumulation x ranks): micro-batch {batch} x {accum} accumulation step(s) x {dp_degree}"
                     + (f" ({chosen} does not divide it)" if batch != chosen else ""))
    elif batch * accum * dp_degree != dataset.batch_size * accumulation.steps * dp_degree:
        lines.append(f"  note: the global batch changes from {dataset.batch_size * accumulation.steps * dp_degree} to "
                     f"{batch * accum * dp_degree}, and with it the optimisation (retune the lr with tune=lr_find, or keep "
                     f"it with tune.keep_global_batch=true)")
    override = f"dataset.batch_size={batch}" + (f" accumulation.steps={accum}" if accum != accumulation.steps else "")
    lines.append(f"  suggested: {override}   (now dataset.batch_size={dataset.batch_size}"
                 + (f" accumulation.steps={accumulation.steps})" if accum != accumulation.steps else ")"))
    applied = spec.replace(dataset=_replace(dataset, batch_size=batch), accumulation=_replace(accumulation, steps=accum))
    return applied, lines


def describe(found: BatchSearch, tune: TuneSpec, device: torch.device, dp_degree: int) -> list[str]:
    rates = "  ".join(f"{b}: {found.throughput[b]:,.0f}" for b in sorted(found.throughput))
    best = max(found.throughput, key=found.throughput.get)
    lines = [f"batch_size: samples/s by micro-batch per rank ({dp_degree} rank(s), {device.type}): {rates}",
             f"  search: {found.stopped}"]
    if found.too_big:
        lines.append(f"  largest micro-batch that fits: {found.largest_fit} ({min(found.too_big)} ran out of memory)")
    elif device.type == "cuda":
        lines.append(f"  largest micro-batch that fits: at least {found.largest_fit} (none tried ran out of memory)")
    else:
        lines.append("  on a CPU only throughput counts: memory is not probed")
    lines.append(f"  throughput knee: {knee(found.throughput, tune.knee_tolerance)} (within {tune.knee_tolerance:.0%} "
                 f"of the best, {found.throughput[best]:,.0f} samples/s at {best})")
    return lines


def find_batch_size(engine, tune: TuneSpec, until_oom: bool | None = None) -> BatchSearch:
    """Searches the micro-batch on the engine's own steps; its state is put back after each candidate."""
    until_oom = engine.device.type == "cuda" if until_oom is None else until_oom
    dp_degree, sampler = engine.env.dp_degree, engine.train_loader.batch_sampler
    cap = min(tune.max_batch_size, engine.split_sizes["train"] // dp_degree)
    with probing(engine) as saved:
        engine.steps.train_mode(True)
        engine.steps.micro_batches_follow(True)  # under pp: each candidate's pipeline micro-batches cut from its rows

        def probe(batch: int) -> float | None:
            sampler.batch_size = batch
            with _as_configured(engine, batch):
                rate = _timed(engine, tune.steps_per_candidate)
            saved.restore(engine)
            log.info("batch_size: %d -> %s", batch, "out of memory" if rate is None else f"{rate:,.0f} samples/s")
            return rate

        try:
            return search(probe, cap, tune.knee_tolerance, until_oom)
        finally:
            engine.steps.micro_batches_follow(False)


@contextlib.contextmanager
def _as_configured(engine, batch: int):
    """The engine stepping as a run configured with micro-batch `batch` would: under trainer.compile its full
    micro-batches run compiled (the engine runs a batch of another size than dataset.batch_size uncompiled),
    each candidate with its own static-shape graph as that run would compile, not one made dynamic by the
    candidates before it. Afterwards the compiled graphs of the candidates are dropped."""
    spec = engine.spec
    if not spec.trainer.compile:
        yield
        return
    import torch._dynamo

    engine.spec = spec.replace(dataset=_replace(spec.dataset, batch_size=batch))
    try:
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=64):
            yield
    finally:
        engine.spec = spec
        torch._dynamo.reset()


def _timed(engine, steps: int) -> float | None:
    """Samples/s of full micro-batch steps after two untimed ones; None when any rank ran out of memory.
    Every rank takes the same number of steps (their collectives pair up): each verdict and count is agreed."""
    device, batches = engine.device, step_batches(engine, full_only=True)
    for _ in range(2):  # the second step runs with the optimizer's state allocated: the peak
        started = time.perf_counter()
        if not _fits(engine, next(batches)):
            return None
    # enough timed steps for MIN_SECONDS, judged by the slowest rank's untimed step
    (untimed,) = parallel.all_reduce_max([torch.tensor(time.perf_counter() - started, device=device)])
    count = min(max(steps, math.ceil(MIN_SECONDS / max(float(untimed), 1e-9))), 10 * steps)
    times = []
    for _ in range(count):
        _synchronize(device)
        started = time.perf_counter()
        engine.train_step(next(batches))
        _synchronize(device)
        times.append(time.perf_counter() - started)
    # the median step: a pause of the machine (another process, a collection) moves it little
    (seconds,) = parallel.all_reduce_max([torch.tensor(statistics.median(times), device=device)])
    return engine.train_loader.batch_sampler.global_batch / max(float(seconds), 1e-9)


def _fits(engine, batch: list) -> bool:
    """One step, gradients kept local (no collective to strand the other ranks in); whether it fitted on every rank."""
    out_of_memory = False
    try:
        with _no_sync(engine):
            engine.train_step(batch)
    except torch.OutOfMemoryError:
        out_of_memory = True  # the error (and the tensors its frames hold) is released when this block ends
    finally:
        parallel.sync_gradients(engine.model, sync=True)
    if out_of_memory:
        engine.optimizer.zero_grad(set_to_none=True)
        free_memory(engine.device)
    (failed,) = parallel.all_reduce_max([torch.tensor(float(out_of_memory), device=engine.device)])
    return not failed


def _no_sync(engine):
    if not engine.env.distributed:
        return contextlib.nullcontext()
    return parallel.sync_gradients(engine.model, sync=False)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _replace(part, **changes):
    import dataclasses

    return dataclasses.replace(part, **changes)
