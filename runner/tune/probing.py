"""What the finders share: the engine driven step by step with the lr or batch a finder sets, and everything
those steps change (weights, optimizer and loss-scaler state, the random streams, the data position) saved before and put
back after, to the bit; the run's schedule is held still meanwhile (the finder sets the lr).

A finder calls the engine's own `train_step`, so whatever a training step does for the run's task,
precision, accumulation and ddp/fsdp, a probe step does alike.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import math
from typing import Iterator

import torch

from runner.engine import parallel
from runner.engine.loader import optimizer_steps
from runner.engine.rng import rng_state, set_rng_state


class Snapshot:
    """The engine's trainable state at one moment; `restore` puts it back bitwise."""

    def __init__(self, engine) -> None:
        self.model = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        self.optimizer = copy.deepcopy(engine.optimizer.state_dict())
        # the scaler whole: an out-of-memory error between its unscale and its update leaves it mid-step,
        # which its state_dict does not record
        self.scaler = copy.deepcopy(engine.precision.scaler)
        self.skipped_steps = engine.precision.skipped_steps
        self.rng = rng_state()

    def restore(self, engine) -> None:
        engine.optimizer.zero_grad(set_to_none=True)
        engine.module.load_state_dict(self.model)
        engine.optimizer.load_state_dict(self.optimizer)
        engine.precision.scaler = copy.deepcopy(self.scaler)
        engine.precision.skipped_steps = self.skipped_steps
        set_rng_state(self.rng)
        free_memory(engine.device)


class _HeldSchedule:
    """Stands in for the run's schedule while a finder sets the lr itself: train_step's schedule step moves nothing."""

    def step(self) -> None: ...


@contextlib.contextmanager
def probing(engine) -> Iterator[Snapshot]:
    """The engine for a finder's probe steps; on leaving (whatever happened) its state is as on entering."""
    saved = Snapshot(engine)
    schedule, sampler = engine.schedule, engine.train_loader.batch_sampler
    batch_size = sampler.batch_size
    engine.schedule = _HeldSchedule()
    try:
        yield saved
    finally:
        engine.schedule = schedule
        sampler.batch_size = batch_size
        sampler.set_epoch(engine.progress.epoch, start=engine.progress.samples_in_epoch)
        parallel.sync_gradients(engine.model, sync=True)  # FSDP2's flag: a probe may have left it off
        saved.restore(engine)


def step_batches(engine, full_only: bool = False) -> Iterator[list]:
    """The run's optimizer steps (lists of micro-batches), epoch after epoch for as long as a finder asks
    (a sweep longer than an epoch sees the data again). `full_only`: only micro-batches of the loader's
    whole batch on every rank (a ragged last batch would time as another size)."""
    sampler = engine.train_loader.batch_sampler
    full = sampler.size // sampler.global_batch
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        if full_only:
            for i, batch in enumerate(engine.train_loader):
                if i >= full:
                    break
                yield [batch]
        else:
            yield from optimizer_steps(engine.train_loader, engine.accum)
        epoch += 1


def set_base_lr(engine, lr: float) -> None:
    """Every parameter group at `lr` x its own ratio to optimizer.lr (lr multipliers, a hybrid optimizer's groups)."""
    base = engine.spec.optimizer.lr
    for group in engine.optimizer.param_groups:
        group["lr"] = lr * group.get("initial_lr", base) / base


def mean_loss(loss_sum: torch.Tensor, count: int, device: torch.device) -> float:
    """The step's loss averaged over every sample (or token) of all ranks: the same number on every rank."""
    total, n = parallel.all_reduce_sum([loss_sum.detach().double(), torch.tensor(float(count), device=device)])
    return float(total) / max(float(n), 1.0) if math.isfinite(float(total)) else math.inf


def free_memory(device: torch.device) -> None:
    """A GPU's memory handed back to its cache, and the cache emptied (a failed step's tensors may sit in
    reference cycles); on a CPU, freeing is the reference counts' job."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
