"""How the engine's model runs: an optimizer step over its micro-batches, a batch's evaluation sums, a bare
forward. Two strategies share one interface, and the engine holds one of them and calls it without asking
which (the engine's step loop, evaluation and fit have no pipeline branch; add-ons reach the model's parts
through their view):

- `PlainSteps`: one model replica per rank (one process, ddp, fsdp, tp, cp), micro-batches run one after
  another, gradients synchronised on the last only. The tiny-step hot path: nothing here may add a Python
  call per step (`make bench` measures the engine's overhead over a hand loop).
- `PipelineSteps`: parallelism.pp, this rank's stages run by the schedule (runner/engine/parallel/pipeline.py).

The interface:

    train_step(step_batches, counts) -> (loss_sum, units, grad_norm)
        one optimizer step over the accumulation micro-batches (split, with their unit counts): the loss
        scaled by dp degree / the step's units on all replicas, clipping, the optimizer and scheduler step;
        the grad norm where the run clips or the step logs (monitor.logs), else None;
        this rank's FLOPs of it are left in `last_step_flops`
    eval_sums(batch, count) -> {name: sum}   the task's metric sums of one prepared batch
    finish_eval(totals) -> totals            the whole split's sums as every rank of a replica holds them
    forward(batch)                           the model's output on a prepared batch (None on a rank without it)
    train_mode(training)                     train()/eval() on every module this rank runs
    parts() -> [modules]                     the model's modules this rank holds
    holds_batchnorm() -> bool                whether the model has a BatchNorm (every rank answers alike)
    bubble() -> float | None                 the pipeline's measured bubble so far
    report_memory()                          the memory estimate printed before training
    micro_batches_follow(on)                 a finder's candidates: micro-batches cut from each batch's rows

A strategy is the engine's own step moved beside it: it reads the engine's live parts (the optimizer, the
schedule a finder may hold still, the precision, the monitor, the batch preparation) through the engine it
steps, as the step did when it was an Engine method.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, ContextManager, Iterator

import torch

from runner import tasks
from runner.addons.profiling import OFF, Phases
from runner.engine import compiling, memory_estimate, parallel
from runner.engine.parallel import context, tensor as tensor_parallel
from runner.tasks import batches

if TYPE_CHECKING:
    from runner.engine.engine import Engine
    from runner.engine.parallel.pipeline import Pipeline

log = logging.getLogger(__name__)

_NO_CONTEXT = contextlib.nullcontext()  # reusable: entering it has no state


def build(engine: "Engine", pipeline: "Pipeline | None") -> "PlainSteps | PipelineSteps":
    """The engine's strategy: the pipeline's where the run cut the model into stages, else the plain one."""
    return PipelineSteps(engine, pipeline) if pipeline is not None else PlainSteps(engine)


def _has_batchnorm(modules: list[torch.nn.Module]) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for part in modules for m in part.modules())


class PlainSteps:
    """The model as one piece on each rank (single, ddp, fsdp, tp, cp)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        # read once: what the engine decided when it was built
        self.distributed, self.dp_degree, self.cp_mesh = engine.distributed, engine.dp_degree, engine.cp_mesh
        self.clips, self._loss_context = engine.clips, engine._loss_context  # tp's sharded loss, or a shared no-op
        # whether a training batch is moved, cast or transformed before the model sees it (engine._prepare); on a CPU
        # with none of these it is ready as the loader gives it
        self.prepares = engine.moves_batches or engine.precision.casts_batches or engine.batch_transform is not None
        # whether the layout wraps each micro-step in contexts besides ddp/fsdp's gradient sync (cp, tp's loss)
        self.wraps_micro_steps = self.cp_mesh is not None or engine.shards_loss
        self.last_step_flops = 0.0  # this rank's FLOPs of the last train_step
        self.flops_per_sample: float | None = None  # engine.fixed_flops: FlopCount's own, once it counted the training shape

    def train_step(self, step_batches: list, counts: list) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        e = self.engine
        phase = e.profiler.phase  # the profiler's timed contexts on a profiled step; OFF (no-ops) on every other
        total = units = sum(counts)  # this rank's
        if self.distributed:
            with phase.rank_sync:  # an all-reduce: where a rank waits for the slower ones
                total = parallel.global_count(units, e.device)  # a device tensor: no host sync here
        # (`or`, not max(): a builtin's call costs a tiny step ~1.3k instructions)
        scale = self.dp_degree / (total.clamp_min(1) if isinstance(total, torch.Tensor) else total or 1)
        if phase is OFF and len(step_batches) == 1 and not self.wraps_micro_steps:
            # the usual step: one micro-batch, nothing around its forward and backward (no accumulation's sync, cp,
            # tp loss or profiled phase), so no context is entered: each costs a tiny step ~1.5k instructions
            loss_sum, step_flops = self._micro_step(step_batches[0], counts[0], scale)
            grad_norm = self._optimizer_step()
        else:
            loss_sum, step_flops = self._micro_steps(step_batches, counts, scale, phase)
            with phase.optimizer:
                grad_norm = self._optimizer_step()
        self.last_step_flops = step_flops
        return loss_sum, units, grad_norm

    def _micro_step(self, batch: tasks.Batch, count: int, scale: float | torch.Tensor) -> tuple[torch.Tensor, float]:
        """Forward, loss and backward of a micro-batch that nothing wraps: its loss sum (detached) and FLOPs."""
        e = self.engine
        if self.prepares:
            batch = e._prepare(batch, train=True)
        flops = 0.0 if batch.empty else self._micro_step_flops(batch)  # a stand-in for an empty share trains nothing
        loss = self._loss_sum(batch, count)
        e.precision.backward(loss, scale)
        return loss.detach(), flops

    def _micro_steps(self, step_batches: list, counts: list, scale: float | torch.Tensor, phase: Phases
                     ) -> tuple[torch.Tensor, float]:
        """`_micro_step` of each micro-batch, inside the contexts that apply: the parallel layout's, and the
        profiler's phases on a profiled step. The step's loss sum (detached) and FLOPs."""
        e = self.engine
        losses, step_flops = [], 0.0
        last = len(step_batches) - 1
        for i, (batch, count) in enumerate(zip(step_batches, counts)):
            with phase.to_device:
                if self.prepares:
                    batch = e._prepare(batch, train=True)
            if not batch.empty:
                step_flops += self._micro_step_flops(batch)
            with self._layout(batch, sync=i == last, accumulates=last > 0) as share:
                share = share or batch
                with phase.forward:
                    loss = self._loss_sum(share, count)
                with phase.backward:
                    e.precision.backward(loss, scale)
            losses.append(loss.detach())
        loss_sum = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        if self.cp_mesh is not None:
            context.sum_gradients(e.module, self.cp_mesh)  # each cp rank's gradient is of its share: summed
            loss_sum = context.whole_sequence(loss_sum, self.cp_mesh)
        return loss_sum, step_flops

    def _optimizer_step(self) -> torch.Tensor | None:
        """Clipping, the optimizer's and the schedule's step; the grad norm where it clips or the step logs, else None."""
        e = self.engine
        grad_norm = self._clip_gradients() if self.clips or e.monitor.logs else None
        if e.precision.step(e.optimizer):
            e.schedule.step()
        e.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _layout(self, batch: tasks.Batch, sync: bool, accumulates: bool) -> ContextManager:
        """What the parallel layout wraps a micro-step's forward and backward in, entered as the batch this rank
        computes on (None: the batch itself). One shared no-op where nothing applies (one micro-step a step,
        no cp, no tp loss): no context is built for it each step."""
        if not (accumulates or self.wraps_micro_steps):
            return _NO_CONTEXT
        return self._layout_contexts(batch, sync, accumulates)

    @contextlib.contextmanager
    def _layout_contexts(self, batch: tasks.Batch, sync: bool, accumulates: bool) -> Iterator[Any]:
        # under accumulation ddp/fsdp sync gradients on the last micro-step only; cp: this rank's share of the
        # sequences (the count, and so the scale, is the whole batch's); tp: the loss on vocabulary-sharded logits,
        # and its backward
        cp_mesh = self.cp_mesh
        with parallel.sync_gradients(self.engine.model, sync=sync) if accumulates else _NO_CONTEXT, \
                context.for_step(cp_mesh, batch) if cp_mesh is not None else _NO_CONTEXT as share, \
                self._loss_context():
            yield share

    def _micro_step_flops(self, batch: tasks.Batch) -> float:
        """FLOPs of a training micro-step on a prepared batch (0 where the model cannot be counted); under fixed_flops
        the per-sample count FlopCount.of keeps for the batch's shape, times its samples, as `of` computes it."""
        if self.flops_per_sample is not None:
            return self.flops_per_sample * batch.inputs.shape[0]
        e = self.engine
        flops = e.flop_count.of(batch, e.monitor.window.paused) or 0.0
        if e.fixed_flops and len(e.flop_count.per_sample) == 1:  # the one shape's, with these parameters training
            self.flops_per_sample = next(iter(e.flop_count.per_sample.values()))
        return flops

    def _model_for(self, batch: tasks.Batch) -> torch.nn.Module:
        """The model to run `batch`: under trainer.compile a ragged batch runs it uncompiled."""
        e = self.engine
        return compiling.for_batch(e.model, batch.inputs, e.spec) if e.compiled else e.model

    def _loss_sum(self, batch: tasks.Batch, count: int) -> torch.Tensor:
        """A stand-in for an empty share is forwarded like any batch and its loss multiplied by 0: under
        DDP every parameter still gets its (zero) gradient for the step's all-reduce, under FSDP the
        forward's all-gathers and the backward's reduce-scatters run on every rank in step. Skipping the
        forward (a zero loss built from the parameters) would leave FSDP's collectives one rank short."""
        e = self.engine
        model = self._model_for(batch) if e.compiled else e.model  # the test first: a call less per step
        if e.precision.autocasts:
            with e.precision.autocast():
                output = batches.call_model(model, batch, e.pass_labels)
        else:  # no context entered where there is no autocast (fp32, tf32, bf16_true)
            output = batches.call_model(model, batch, e.pass_labels)
        # the compiled loss goes with the compiled model: a ragged batch's would recompile it
        task = e.compiled_task if e.compiled_task is not None and model is e.model else e.task
        return batches.loss_sum(output, batch, count, task, e.spec.model.target)

    def _clip_gradients(self) -> torch.Tensor:
        """Clips as the run says; returns the gradients' norm (before clipping)."""
        e = self.engine
        trainer = e.spec.trainer
        e.precision.unscale(e.optimizer)
        params = [p for p in e.params if p.grad is not None]
        if trainer.clip_grad_value is not None:
            parallel.clip_grad_value(params, trainer.clip_grad_value)
        if trainer.clip_grad_norm is not None:  # on sharded (DTensor) grads the norm is reduced across ranks
            return parallel.clip_grad_norm(params, trainer.clip_grad_norm)
        return parallel.grad_norm([p.grad for p in params])

    def eval_sums(self, batch: tasks.Batch, count: int) -> dict[str, torch.Tensor]:
        e = self.engine
        with e.precision.autocast():
            output = batches.call_model(self._model_for(batch), batch, e.pass_labels)
        return batches.eval_sums(output, batch, count, e.task, e.spec.model.target)

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return totals

    def forward(self, batch: tasks.Batch) -> Any:
        """The bare module (not its DDP wrapper, whose forward would broadcast rank 0's buffers) on a batch."""
        e = self.engine
        with e.precision.autocast():
            return batches.call_model(e.module, batch, e.pass_labels)

    def train_mode(self, training: bool) -> None:
        self.engine.model.train(training)

    def parts(self) -> list[torch.nn.Module]:
        return [self.engine.module]

    def holds_batchnorm(self) -> bool:
        return _has_batchnorm(self.parts())

    def bubble(self) -> float | None:
        return None

    def report_memory(self) -> None:
        e = self.engine
        with tensor_parallel.loss_context(e.spec.parallelism, e.env):  # tp's sharded loss
            memory_estimate.report(e.spec, e.module, e.optimizer, e.device, e.env, e.tracker, e.train_loader,
                                   self._micro_loss)

    def _micro_loss(self, raw) -> torch.Tensor:
        """The memory estimate's micro-step, eager even under trainer.compile: a compilation here would fall
        outside the steps the compile clock times (and eager activations bound the compiled ones from above)."""
        e = self.engine
        batch = e._prepare(batches.split_batch(raw), train=True)
        count = 0 if batch.empty else e.task.count(batch.labels)
        with e.precision.autocast():
            output = batches.call_model(getattr(e.model, "_orig_mod", e.model), batch, e.pass_labels)
        return batches.loss_sum(output, batch, count, e.task, e.spec.model.target)

    def micro_batches_follow(self, on: bool) -> None:
        """Nothing to do: every micro-batch runs at its own size."""


class PipelineSteps:
    """parallelism.pp: each accumulation micro-batch runs through the schedule (its own pipeline micro-batches
    inside); the loss is the last stage's, scaled by the units of the whole step, and reaches every stage."""

    def __init__(self, engine: "Engine", pipeline: "Pipeline"):
        self.engine, self.pipeline = engine, pipeline
        self.clips = engine.clips
        self.last_step_flops = 0.0
        self._eval_names: list[str] | None = None  # the metric sums' names, for the stages without the head
        self._batchnorm = pipeline.holds_batchnorm()  # agreed over the stages: each rank holds only its own
        if self._batchnorm:
            pipeline.check_batchnorm()
            pipeline.micro_batches_follow(True)  # no padded row enters a BatchNorm's statistics

    def _loss_context(self):
        # the last stage's loss and the schedule's backward of it: on vocabulary-sharded logits under loss_parallel
        e = self.engine
        return tensor_parallel.loss_context(e.spec.parallelism, e.env)

    def train_step(self, step_batches: list, counts: list) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        e, pipeline = self.engine, self.pipeline
        total = parallel.global_count(sum(counts), e.device)
        scale = e.env.dp_degree / (total.clamp_min(1) if isinstance(total, torch.Tensor) else max(total, 1))
        losses, step_flops = [], 0.0
        for batch in step_batches:
            batch = e._prepare(batch, train=True)
            if not batch.empty:
                step_flops += e.flop_count.of(batch, e.monitor.window.paused) or 0.0
            with e.precision.autocast(), self._loss_context():
                losses.append(pipeline.train(batch.inputs, batch.labels, _rows(batch), batch.empty, scale))
        loss_sum = pipeline.sum_over_stages([torch.stack(losses).sum()])[0].float()
        pipeline.sync_tied_gradients()
        pipeline.average_over_replicas()
        trainer, grad_norm = e.spec.trainer, None
        if self.clips or e.monitor.logs:  # the norm where it clips, or is logged
            grad_norm = pipeline.clip_gradients(trainer.clip_grad_norm, trainer.clip_grad_value)
        if e.precision.step(e.optimizer):
            e.schedule.step()
        e.optimizer.zero_grad(set_to_none=True)
        self.last_step_flops = step_flops
        return loss_sum, sum(counts), grad_norm

    def eval_sums(self, batch: tasks.Batch, count: int) -> dict[str, torch.Tensor]:
        """The last stage's sums; zeros of the same names elsewhere (finish_eval sums them over the stages)."""
        e = self.engine
        output = self.forward(batch)
        sums = None if output is None else batches.eval_sums(output, batch, count, e.task, e.spec.model.target)
        if self._eval_names is None:  # once: the last stage tells the others
            self._eval_names = self.pipeline.agree(sorted(sums) if sums is not None else None)
        return sums if sums is not None else {name: torch.zeros((), device=e.device) for name in self._eval_names}

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The last stage's sums reach every stage, so that every rank decides alike (early stopping, the best weights)."""
        names = sorted(totals)
        return dict(zip(names, self.pipeline.sum_over_stages([totals[n] for n in names])))

    def forward(self, batch: tasks.Batch) -> Any:
        """Forward only, through every stage (the schedule computes the last stage's loss too); the output on the
        rank holding the last stage, None elsewhere. Every rank of the pipeline calls it with the same batch."""
        e = self.engine
        with e.precision.autocast(), self._loss_context():
            return self.pipeline.forward(batch.inputs, batch.labels, _rows(batch))

    def train_mode(self, training: bool) -> None:
        self.pipeline.train_mode(training)

    def parts(self) -> list[torch.nn.Module]:
        return list(self.pipeline.stage_modules)

    def holds_batchnorm(self) -> bool:
        return self._batchnorm

    def bubble(self) -> float | None:
        return self.pipeline.bubble()

    def report_memory(self) -> None:
        """Each rank's figures for its own stages; no activations (no micro-step runs outside the schedule)."""
        e = self.engine
        memory_estimate.report(e.spec, e.module, e.optimizer, e.device, e.env, e.tracker, e.train_loader, None)

    def micro_batches_follow(self, on: bool) -> None:
        """A finder's candidates run at their own size: the micro-batches are cut from each batch's rows, not the
        configured batch's (otherwise every candidate would run the configured rows)."""
        self.pipeline.micro_batches_follow(on or self._batchnorm)


def _rows(batch: tasks.Batch) -> int:
    """The batch's number of samples (its first tensor's first dimension)."""
    inputs = batch.inputs
    first = next(v for v in inputs.values() if isinstance(v, torch.Tensor)) if isinstance(inputs, dict) else inputs
    return first.shape[0]
