"""Weight averaging: an exponential moving average of the weights (EMA, `trainer.ema`) and stochastic
weight averaging over the last epochs (SWA, `trainer.swa`), each evaluated, logged and checkpointed
beside the raw weights.

- EMA: EMA_0 = the weights the run starts from; after every optimizer step t (not every micro-batch)
  EMA_t = d_t * EMA_(t-1) + (1 - d_t) * W_t, with d_t = decay, or with `warmup` d_t = min(decay,
  (1 + t) / (10 + t)) (TensorFlow's num_updates rule: early steps weigh more, so the average does
  not stay near the random start for ~1/(1 - decay) steps).
- SWA: the mean of the weights at the end of epoch `start_epoch` (counted from 0) and every later one.
  With `swa.lr`, torch's SWALR anneals the lr to it from the start of that epoch.
- Buffers: floating buffers (BatchNorm's running statistics) are averaged like the parameters, as
  torch's AveragedModel(use_buffers=True) and timm's ModelEma do: statistics of the current weights
  would not match the averaged ones, and averaging them costs no pass over the data. Integer buffers
  (num_batches_tracked) are copied. For SWA the statistics are then recomputed for the averaged
  weights with torch's update_bn at the end of training (its test metrics use them), as SWA's paper does.
- Evaluation: the averaged weights are copied into the model in place for the evaluation and the raw
  ones back after it, so the same wrapped (DDP, FSDP, compiled) model evaluates them; their metrics
  are `<split>/ema/<name>` and `<split>/swa/<name>`.
- Parallel: under ddp every rank averages its full (identical) weights; under fsdp every rank averages
  its own shards (averaging is elementwise, so the shards of the average are the averages of the
  shards); under pp every rank its own stages' weights, evaluated through the pipeline. Checkpoints hold
  each rank's shards of the averages beside the model's (`sharded_state`, laid out as the weights they
  average), so they reshard on load like the model.

torch.optim.swa_utils.AveragedModel is not used as a whole: it deep-copies the module, which for an
FSDP-sharded or compiled model would need its own wrap to be evaluated, and it keeps the average in
the model's dtype (bf16_true would lose every EMA update below bf16's resolution). Its update rules
(get_ema_multi_avg_fn, get_swa_multi_avg_fn), SWALR and update_bn are used as they are.
"""
from __future__ import annotations

import contextlib
import logging
import re
import warnings
from typing import Any, Iterator

import torch
from torch.optim.swa_utils import SWALR, get_ema_multi_avg_fn, get_swa_multi_avg_fn, update_bn

from runner.engine.parallel import all_reduce_sum, local_tensor_of
from runner.engine.parallel.state import AVERAGES
from runner.addons.base import AddOn, EngineView, Progress
from runner.specs.trainer import SwaSpec
from runner.specs.run import RunSpec, SpecError

log = logging.getLogger(__name__)


class Average:
    """One running average of a module's parameters and persistent buffers: fp32 copies of the local
    tensors (shards under fsdp), and how many weights it has taken in."""

    def __init__(self, kind: str, tensors: dict[str, torch.Tensor]):
        self.kind = kind
        self.values = {name: local_tensor_of(t).detach().clone().to(_average_dtype(t)) for name, t in tensors.items()}
        self.count = 0

    def update(self, tensors: dict[str, torch.Tensor], multi_avg_fn) -> None:
        """Folds the current weights in with torch's multi-tensor rule (a lerp over every tensor at once)."""
        floats = [name for name in self.values if self.values[name].is_floating_point()]
        current = [local_tensor_of(tensors[name]).detach().to(self.values[name].dtype) for name in floats]
        if floats:
            multi_avg_fn([self.values[name] for name in floats], current, self.count)
        for name, value in self.values.items():
            if not value.is_floating_point():
                value.copy_(local_tensor_of(tensors[name]))
        self.count += 1

    def reset_to(self, tensors: dict[str, torch.Tensor]) -> None:
        """Starts over from these weights (nothing taken in yet)."""
        for name, value in self.values.items():
            value.copy_(local_tensor_of(tensors[name]))
        self.count = 0

    def sharded_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's values laid out as the weights they average (a DTensor over this rank's shard where the
        weight is one: no copy, so a checkpoint's load fills them in place), keyed averages/<kind>/<name>."""
        return {f"{AVERAGES}{self.kind}/{name}": _like(value, tensors[name]) for name, value in self.values.items()}


class Averages(AddOn):
    """The run's averaged weights, an add-on (runner/addons/base.py) that the engine also asks for the
    averages' metrics of each evaluation (`evaluate`); every method does nothing when both averagings are off."""

    name = "averages"

    def __init__(self, view: EngineView):
        spec = view.spec
        self.view, self.ema_spec, self.swa_spec = view, spec.trainer.ema, spec.trainer.swa
        on = self.ema_spec.decay is not None or self.swa_spec.start_epoch is not None
        tensors = self._tensors = _named_tensors(view.module) if on else {}  # the module's own, updated in place
        self.ema = Average("ema", tensors) if self.ema_spec.decay is not None else None
        self.swa = Average("swa", tensors) if self.swa_spec.start_epoch is not None else None
        if self.swa is not None:
            _check_swa_reached(spec, view.total_steps, view.steps_per_epoch)
        if self.ema is None:
            self.idle = frozenset({"on_step_end"})

    def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> None:
        """After optimizer step `step` (1-based): the EMA takes the new weights in."""
        if self.ema is None:
            return
        decay = self.ema_spec.decay
        if self.ema_spec.warmup:
            decay = min(decay, (1 + step) / (10 + step))
        self.ema.update(self._tensors, get_ema_multi_avg_fn(decay))

    def on_epoch_end(self, epochs_done: int) -> None:
        """After the end of epoch `epochs_done - 1`: SWA takes the weights in from its start epoch on."""
        if self.swa is not None and epochs_done - 1 >= self.swa_spec.start_epoch:
            self.swa.update(self._tensors, get_swa_multi_avg_fn())

    def evaluate(self, split: str) -> dict[str, float]:
        """The engine's evaluation of each averaged weights, as `<split>/<ema|swa>/<name>`."""
        out: dict[str, float] = {}
        for average in self._active():
            with self._swapped_in(average):
                metrics = self.view.evaluate_model(split)
            out.update({_averaged_name(name, average.kind): value for name, value in metrics.items()})
        return out

    def on_train_end(self, stop: Any) -> None:
        """Training ended (not paused: a paused run's SWA goes on averaging): SWA's BatchNorm statistics."""
        if not stop.paused and not stop.pruned:
            self.finish()

    def finish(self) -> None:
        """BatchNorm statistics recomputed for the SWA weights over the training data (the end of training,
        and the best SWA weights the test uses)."""
        if self.swa is None or not self.swa.count or not self.view.holds_batchnorm:
            return
        buffers = {name for name, _ in self.view.module.named_buffers()} & set(self.swa.values)
        with self._swapped_in(self.swa, keep=buffers):
            _recompute_batchnorm(self.view)

    def sharded_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards of both averages, for a checkpoint's tensors (runner/engine/parallel/state.py loads
        them in place at any mesh, before load_state_dict)."""
        return {k: v for a in (self.ema, self.swa) if a is not None for k, v in a.sharded_state(self._tensors).items()}

    def state_dict(self) -> dict | None:
        """For the checkpoint's record: how many weights each average took in (their values are sharded_state)."""
        if self.ema is None and self.swa is None:
            return None
        return {a.kind: {"count": a.count} for a in (self.ema, self.swa) if a is not None}

    def whole_state(self) -> dict | None:
        """Counts and values as whole CPU tensors (a collective under fsdp): for a run that writes no checkpoint."""
        from runner.engine.parallel.state import gathered

        return None if self.ema is None and self.swa is None else {
            a.kind: {"count": a.count, "values": {name: gathered(_like(v, self._tensors[name])).cpu()
                                                  for name, v in a.values.items()}}
            for a in (self.ema, self.swa) if a is not None}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's averages, whose values its load filled in already; None (a checkpoint without them, or a
        tool that trained and put the starting weights back, such as an lr finder) starts both over from the
        module's weights."""
        for average in (self.ema, self.swa):
            if average is None:
                continue
            if state and state.get(average.kind) is not None:
                average.count = int(state[average.kind]["count"])
            else:  # a checkpoint saved without this average: it starts from the loaded weights
                average.reset_to(self._tensors)

    # --- internals ------------------------------------------------------------------------------

    def _active(self) -> list[Average]:
        return [a for a in (self.ema, self.swa) if a is not None and (a.kind == "ema" or a.count)]

    @contextlib.contextmanager
    def _swapped_in(self, average: Average, keep: set[str] = frozenset()) -> Iterator[None]:
        """The averaged weights in the model, the raw ones back afterwards; what the tensors named in
        `keep` hold at the end goes back into the average (update_bn's statistics; not the parameters,
        which a bf16 model would hand back rounded)."""
        tensors = self._tensors
        with torch.no_grad():
            raw = {name: local_tensor_of(t).detach().clone() for name, t in tensors.items()}
            for name, value in average.values.items():
                local_tensor_of(tensors[name]).copy_(value)
            try:
                yield
                for name in keep:
                    average.values[name].copy_(local_tensor_of(tensors[name]))
            finally:
                for name, value in raw.items():
                    local_tensor_of(tensors[name]).copy_(value)


def swa_schedule(spec: SwaSpec, base: Any, optimizer: torch.optim.Optimizer, progress: Progress,
                 steps_per_epoch: int) -> Any:
    """The run's lr schedule, handing over to SWALR at SWA's first epoch when `trainer.swa.lr` is set."""
    if spec.start_epoch is None or spec.lr is None:
        return base
    return SwaSchedule(base, optimizer, progress, spec, steps_per_epoch)


class SwaSchedule:
    """The run's schedule until SWA's first epoch, then torch's SWALR (annealing to `swa.lr` over
    `anneal_epochs`, in optimizer steps: one optimizer step is one scheduler step). A schedule driven by
    evaluations (plateau) stops reacting once SWA holds the lr."""

    def __init__(self, base: Any, optimizer: torch.optim.Optimizer, progress: Progress, spec: SwaSpec,
                 steps_per_epoch: int):
        self.base, self.optimizer, self.progress, self.spec = base, optimizer, progress, spec
        self.anneal_steps = spec.anneal_epochs * steps_per_epoch
        self.swalr: SWALR | None = None
        for group in optimizer.param_groups:
            # SWALR adds this key to the groups: set from the start, a checkpoint written before SWA's first
            # epoch and one written after hold the same keys (loading the optimizer's state compares them)
            group["swa_lr"] = spec.lr * group.get("lr_multiplier", 1.0)  # multipliers keep their ratio

    def step(self) -> None:
        if self.progress.epoch < self.spec.start_epoch:
            self.base.step()
            return
        if self.swalr is not None:
            self.swalr.step()
            return
        self.swalr = self._make()
        with warnings.catch_warnings():
            # made after this step's optimizer step: torch cannot know that it ran (the base schedule being
            # plateau, nothing had wrapped optimizer.step to record it) and would warn of the wrong order
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"), UserWarning)
            self.swalr.step()

    def _make(self) -> SWALR:
        swa_lr = [group["swa_lr"] for group in self.optimizer.param_groups]
        return SWALR(self.optimizer, swa_lr, anneal_epochs=self.anneal_steps, anneal_strategy="cos")

    def on_eval(self, metrics: dict[str, float]) -> None:
        if self.swalr is None:
            self.base.on_eval(metrics)

    def scale_peak(self, index: int, factor: float) -> None:
        """A changed lr mid-run (PBT's explore): the base schedule's peak; SWALR anneals from the group's lr."""
        self.base.scale_peak(index, factor)

    def state_dict(self) -> dict:
        return {"base": self.base.state_dict(), "swalr": self.swalr.state_dict() if self.swalr is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.base.load_state_dict(state["base"])
        if state.get("swalr") is not None:
            self.swalr = self._make()
            self.swalr.load_state_dict(state["swalr"])


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and persistent buffers by name (tied parameters once)."""
    persistent = set(module.state_dict(keep_vars=True))
    tensors = dict(module.named_parameters())
    tensors.update((name, b) for name, b in module.named_buffers() if name in persistent)
    return tensors


def _averaged_name(metric: str, kind: str) -> str:
    split, _, name = metric.partition("/")
    return f"{split}/{kind}/{name}"


def _check_swa_reached(spec: RunSpec, total_steps: int, steps_per_epoch: int) -> None:
    """With max_steps the last epoch is known only once the data is: SWA must see one epoch's end."""
    epochs = total_steps // steps_per_epoch  # complete epochs the run trains
    start = spec.trainer.swa.start_epoch
    if start >= epochs:
        allowed = f"allowed: 0 to {epochs - 1}" if epochs else "train at least one epoch"
        raise SpecError(f"trainer.swa.start_epoch: {start} is never reached: the run trains {total_steps} steps, "
                        f"{epochs} complete epoch(s) of {steps_per_epoch} steps; {allowed}")


def _average_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision floats (bf16_true): an EMA update of (1 - 0.999) x a small change would
    round away in bf16."""
    return torch.float32 if t.is_floating_point() and t.element_size() < 4 else t.dtype


def _like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's part of an average) as a DTensor laid out as the weight `like`, sharing its storage."""
    if not hasattr(like, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _batchnorms(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


class _Forward(torch.nn.Module):
    """update_bn's model: one prepared batch through the model's parts as the engine runs them (under pp
    through every stage: this rank's part of the model alone cannot take the batch)."""

    def __init__(self, view: EngineView):
        super().__init__()
        self.view, self.parts = view, torch.nn.ModuleList(view.parts or [view.module])

    def forward(self, batch: Any) -> Any:
        return self.view.forward(batch)


def _recompute_batchnorm(view: EngineView) -> None:
    """torch's update_bn over one pass of the training split (the module itself, not its DDP wrapper,
    whose forward would broadcast rank 0's statistics); the ranks' statistics are then averaged over the
    data-parallel replicas. The RNG (dropout) is left as it was, so a resumed run computes the same statistics.
    Under pp every rank runs the pass, its stages holding a BatchNorm or not: the stages forward together."""

    def prepared() -> Iterator[list]:
        for batch in view.train_batches():
            yield [batch]  # a list: update_bn would take a (named) tuple's first item as the whole input

    model = _Forward(view)
    devices = [view.device] if view.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if _batchnorms(model):
            update_bn(prepared(), model)
        else:  # update_bn would return at once: the pass as it runs it, for the stages that hold one
            was_training = model.training
            model.train()
            for (batch,) in prepared():
                model(batch)
            model.train(was_training)
    if view.env.dp_degree > 1:
        for m in _batchnorms(model):
            for b in (m.running_mean, m.running_var):
                if b is not None:
                    (total,) = all_reduce_sum([b])
                    b.copy_(total / view.env.dp_degree)
    log.info("SWA: BatchNorm statistics recomputed for the averaged weights over the training data")
