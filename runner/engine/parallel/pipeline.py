"""Pipeline parallelism: the model cut into consecutive stages on mesh["pp"], run by a schedule of
torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B, looped BFS, the zero-bubble ones).

Stages come from the run's plan (`parallelism.pp_plan`: fn(model, stage_index, num_stages, **params) ->
module) or the model's own `pipeline_stage(stage_index, num_stages)`. A stage keeps the whole model's
parameter names (parts outside it are nn.Identity or None), so this rank's part of the model, `module`,
has the whole model's names too: its state dict is the whole model's restricted to this rank, so a sharded
checkpoint (runner/engine/parallel/state.py) is keyed alike at every mesh and loads at any.

Exactness: every pp rank gets the same batch. Each batch is cut into `pp_microbatches` micro-batches of
one size (ceil(per-rank batch / micro-batches) rows; the schedule's receive buffers have fixed shapes), the
rows past the batch's end repeating its last row and counting nothing in the loss. The loss is the task's,
summed over each micro-batch's real rows in the last stage and multiplied by the step's scale (the engine's:
dp degree / units of the whole step), so micro-batches of unequal counts change nothing; the schedule
does not scale gradients (scale_grads=False). A parameter the whole model shares between stages (gpt's
lm head tied to the token embedding) has a copy in each stage holding it: its gradient is summed over
those stages before the optimizer step (as Megatron does), so the copies stay equal, and the gradient
norm counts it once. Padded rows and micro-batches assume samples do not mix inside a forward, as
pipelining any batch into micro-batches does: a model with a BatchNorm runs with one micro-batch only, each
batch cut at its own rows (micro_batches_follow), so no padded row enters its statistics. A dict batch
(token ids, a mask) reaches the first stage as keyword arguments, and only the first.

With dp_replicate > 1 (pp x ddp) each stage's gradients are averaged over its replicas here, not by a DDP
wrapper (the schedule calls the stages themselves). With dp_shard > 1 (pp x fsdp) each stage is fully_shard-ed on
dp_shard, and torch's PipelineStage reduces its gradients once, after the schedule's last micro-batch. With
tp > 1 (pp x tp) the tensor plan splits this rank's part, whose parameters the stages share; activations
cross stage boundaries as plain whole tensors (a sequence-parallel stream is gathered before the send and
split again after it), and the last stage's loss runs under loss_parallel. Evaluation runs the schedule forward-only; the last
stage's metric sums are summed over the pp group so that every rank decides alike (early stopping, the
best weights).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from runner.engine.parallel import tied_rows
from runner.engine.parallel.mesh import DistEnv
from runner.engine.parallel.state import local_tensor_of
from runner.specs import composition
from runner.specs.parallelism import MULTI_STAGE_SCHEDULES, ParallelismSpec, check_pipeline_keys
from runner.specs.run import SpecError

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")


def stages_per_rank(par: ParallelismSpec) -> int:
    """pp_stages_per_rank with -1 resolved: 1 for gpipe/1f1b, 2 for the multi-stage schedules."""
    if par.pp_stages_per_rank != -1:
        return par.pp_stages_per_rank
    return 2 if par.pp_schedule in MULTI_STAGE_SCHEDULES else 1


def check_pipeline(par: ParallelismSpec, per_rank_batch: int) -> None:
    """What can be refused from the keys alone: the spec's rule (runner/specs/parallelism.py), which refused
    it already while the spec was built; kept for callers holding only the keys."""
    check_pipeline_keys(par, per_rank_batch)


def check_composition(spec: Any, dims: Any = None) -> None:
    """What pipeline parallelism does not combine with: the composition table's cells (runner/specs/composition.py),
    refused while the spec was built."""
    composition.check(spec)


def microbatches(par: ParallelismSpec) -> int:
    """pp_microbatches with -1 resolved: the number of stages."""
    return par.pp_microbatches if par.pp_microbatches != -1 else par.pp * stages_per_rank(par)


def stage_indices(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages a rank holds, as torch's schedules expect them: rank r holds r, r + pp, ... (looped and
    interleaved), or r and 2pp - 1 - r (the V of zbv)."""
    if schedule == "zbv_zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + j * pp for j in range(per_rank)]


def cut_stage(module: nn.Module, plan: Any, model_name: str, stage_index: int, num_stages: int) -> nn.Module:
    """One stage by the user's plan or the model's own pipeline_stage; refused in one line otherwise."""
    if plan is not None:
        from runner.specs.components import load_target

        fn = load_target("parallelism.pp_plan", plan.target)
        call, key = (lambda: fn(module, stage_index, num_stages, **plan.params)), "parallelism.pp_plan"
    elif hasattr(module, "pipeline_stage"):
        call, key = (lambda: module.pipeline_stage(stage_index, num_stages)), "parallelism.pp"
    else:
        raise SpecError(f"parallelism.pp: {model_name} has no pipeline plan (no pipeline_stage method); set "
                        "parallelism.pp_plan={_target_: my_pkg.stage} (fn(model, stage_index, num_stages) -> the "
                        "stage's module), or use parallelism.pp=1")
    try:
        stage = call()
    except ValueError as e:
        raise SpecError(f"{key}: stage {stage_index} of {num_stages} cannot be cut from {model_name}: "
                        f"{str(e).splitlines()[0]}") from None
    except (AttributeError, KeyError, IndexError, TypeError) as e:
        if plan is None:  # the model's own pipeline_stage failing: its traceback is the model's author's to read
            raise
        # a user's plan naming what the model does not hold (model.layers of a model whose blocks are `blocks`)
        parts = ", ".join(name for name, _ in module.named_children())
        raise SpecError(f"parallelism.pp_plan: {plan.target} failed to cut stage {stage_index} of {num_stages} from "
                        f"{model_name} ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}); allowed: a plan "
                        f"that names the model's own parts (its children: {parts})") from None
    if not isinstance(stage, nn.Module):
        raise SpecError(f"parallelism.pp_plan: {plan.target if plan else model_name} returned "
                        f"{type(stage).__name__}, not the stage's nn.Module")
    return stage


class Pipeline:
    """This rank's stages, their schedule, and `module`: this rank's part of the model under the whole
    model's parameter names (what the optimizer, checkpoints and the averages see)."""

    def __init__(self, model: nn.Module, par: ParallelismSpec, env: DistEnv, device: torch.device,
                 per_rank_batch: int, model_name: str, loss_sum: Callable[[Any, torch.Tensor], torch.Tensor]):
        from torch.distributed.pipelining import PipelineStage

        check_pipeline(par, per_rank_batch)
        self.mesh = env.mesh["pp"]
        self.group = self.mesh.get_group()
        self.dp = env.dims.dp_replicate
        self.dp_group = env.mesh["dp_replicate"].get_group() if self.dp > 1 else None
        self.pp, self.pp_rank = par.pp, dist.get_rank(self.group)
        self.num_stages = par.pp * stages_per_rank(par)
        self.microbatches = microbatches(par)
        self.rows = -(-per_rank_batch // self.microbatches)  # rows of every micro-batch
        self.loss_sum = loss_sum  # (output, labels) -> the task's loss summed over the labels' units
        # the whole model's layout, before any cut: one checkpoint layout at every mesh
        self.full_keys = list(model.state_dict().keys())
        self.param_order = [n for n, _ in model.named_parameters()]
        shared: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            shared.setdefault(id(p), []).append(name)
        self.tied = [names for names in shared.values() if len(names) > 1]

        self.indices = stage_indices(par.pp_schedule, self.pp_rank, self.pp, stages_per_rank(par))
        cut = [cut_stage(model, par.pp_plan, model_name, i, self.num_stages) for i in self.indices]
        if not any(t.is_meta for t in model.parameters()):  # a model built on meta is materialised once sharded
            cut = [stage.to(device) for stage in cut]
        self.stage_modules = cut
        self.module = _rank_part(model, cut)
        self.module._runner_pipeline = self  # state.py: the tied names, and full_model_state merging every stage's part
        self.stages = [PipelineStage(m, i, self.num_stages, device, group=self.group)
                       for m, i in zip(cut, self.indices)]
        self.schedule_name = par.pp_schedule
        self.schedule = self._schedule(par.pp_schedule)
        self._signature: tuple | None = None
        self._step: dict[str, Any] = {}
        # which pp ranks hold a copy of each tied parameter: its gradient is summed over them, its norm
        # counted on the first of them only
        local = {n for m in cut for n, _ in m.named_parameters(remove_duplicate=False)}
        held = [[n in local for n in names] for names in self.tied]
        every = [None] * self.pp
        dist.all_gather_object(every, [any(h) for h in held], group=self.group)
        self.tied_owner = [min(r for r in range(self.pp) if every[r][g]) if any(e[g] for e in every) else -1
                           for g in range(len(self.tied))]
        self.tied_everywhere = [all(e[g] for e in every) for g in range(len(self.tied))]
        self.tied_rows: tied_rows.TiedRows | None = None  # split_tied_state
        self.is_last = any(s.is_last for s in self.stages)
        # the bubble (step_bubble): this rank's seconds computing its stages' chunks (forward, backward,
        # weight gradients) against its seconds inside the training schedule's steps
        self.busy_seconds = self.schedule_seconds = 0.0
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))
        self._timing = False

    def after_tensor_plan(self, spec: ParallelismSpec, env: DistEnv) -> None:
        """pp x tp, once the tensor plan split this rank's part (tensor.apply on `module`): the stages must
        compute with the split parameters, and their boundaries stay plain whole tensors. A stage's output
        that is a DTensor (the residual stream under sequence parallelism) is made whole before it is sent;
        under the model's own plan with sequence_parallel, a later stage's input is split along the sequence
        (dim 1) again, as the plan's first block expects (gpt, vit: the stream between blocks is Shard(1))."""
        from runner.engine.parallel import tensor as tensor_parallel

        if env.dims.tp <= 1:
            return
        own = {n: p for n, p in self.module.named_parameters(remove_duplicate=False)}
        for m in self.stage_modules:
            for name, p in m.named_parameters(remove_duplicate=False):
                if own.get(name) is not p:
                    raise SpecError(f"parallelism.tp: {env.dims.tp} with parallelism.pp={self.pp}: the pipeline plan "
                                    f"copied {name} out of the model, so the tensor plan cannot reach the stage; "
                                    "share the model's modules in each stage (as pipeline_stage of gpt and vit does)")
        tp_mesh = env.mesh["tp"]
        split_input = spec.sequence_parallel and tensor_parallel.plan_source(self.module, spec, env.dims.tp) == "model"
        for stage in self.stages:
            if not stage.is_last:
                stage.submod.register_forward_hook(_whole_output)
            if split_input and not stage.is_first:
                stage.submod.register_forward_pre_hook(_sequence_split_input(tp_mesh))

    def materialised(self) -> None:
        """After the stages' parameters got their memory (parallelize.materialise): `module` holds the stages' objects
        again. to_empty gives a stage's own parameters new objects, and a plan's stage that is a shallow copy of the
        model holds its root's in a dict of its own (vit's class token and positions), which `module` kept on meta:
        the seed then loaded nothing into the stage's, and a checkpoint met meta tensors."""
        _rank_part(self.module, self.stage_modules)

    def shard_stages(self, spec: ParallelismSpec, env: DistEnv, device: torch.device,
                     param_dtype: torch.dtype | None) -> None:
        """pp x fsdp: each stage fully_shard-ed on dp_shard (its blocks one by one, then the stage as the root,
        as torchtitan does). torch's PipelineStage holds the gradient reduction until the schedule's last
        micro-batch, and FSDP's reduce-scatter averages over dp_shard, so average_over_replicas adds nothing."""
        if env.dims.dp_shard <= 1:
            return
        from runner.engine.parallel.wrap import Wrapping, shard

        for m in self.stage_modules:
            shard(m, Wrapping(spec, env, device, param_dtype, find_unused=False))
        # a stage's own parameters (a plan's top-level ones: vit's class token) were replaced in the stage only
        _rank_part(self.module, self.stage_modules)
        self.dp_group = None

    def _timed(self, compute: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self._timing:
                return compute(*args, **kwargs)
            started = time.perf_counter()
            try:
                return compute(*args, **kwargs)
            finally:
                self.busy_seconds += time.perf_counter() - started
        return timed

    def bubble(self) -> float | None:
        """This rank's measured bubble over the training steps so far (see step_bubble); None before any."""
        return step_bubble(self.busy_seconds, self.schedule_seconds) if self.schedule_seconds else None

    def _schedule(self, name: str):
        from torch.distributed import pipelining as pl

        classes = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
                   "looped_bfs": pl.ScheduleLoopedBFS, "interleaved_zero_bubble": pl.ScheduleInterleavedZeroBubble,
                   "zbv_zero_bubble": pl.ScheduleZBVZeroBubble}
        stages = self.stages[0] if name in SINGLE_STAGE_SCHEDULES else self.stages
        try:
            return classes[name](stages, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
        except ValueError as e:
            raise SpecError(f"parallelism.pp_microbatches: {self.microbatches} with pp_schedule={name} and pp={self.pp}: "
                            f"{str(e).splitlines()[0]}") from None

    # --- one batch through the pipeline ---------------------------------------------------------------

    def _loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of micro-batch `index`: the task's sum over its real rows, times the
        step's scale. The schedule's metadata inference calls it too (on micro-batch 0), harmlessly."""
        i = int(index)
        real = self._step["real"][i]
        if real == 0:  # rows past the batch's end only: they count nothing, but the backward still runs
            loss = output.sum() * 0.0
        else:
            start = i * self._step["rows"]
            loss = self.loss_sum(output[:real], self._step["labels"][start:start + real])
        self._step["sums"][i] = loss.detach()
        return loss * self._step["scale"]

    def _split(self, inputs: Any, labels: torch.Tensor, rows: int, empty: bool) -> tuple[list, list, list]:
        """Micro-batches of `self.rows` rows each (or, following the batch, of its own rows split evenly),
        padded past the batch's end by repeating its last row."""
        size = -(-rows // self.microbatches) if getattr(self, "_follow_batch", False) else self.rows
        total = size * self.microbatches
        index = torch.arange(total, device=labels.device).clamp_(max=rows - 1)

        def pad(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            return t.index_select(0, index.to(t.device)).split(size)

        self._step["rows"] = size
        self._step["real"] = [0 if empty else max(0, min(size, rows - i * size)) for i in range(self.microbatches)]
        if isinstance(inputs, dict):
            self._first_stage_takes_kwargs()
            parts = {k: pad(v) for k, v in inputs.items()}
            kwarg_mbs = [{k: (v[i] if isinstance(v, tuple) else v) for k, v in parts.items()}
                         for i in range(self.microbatches)]
            arg_mbs = [()] * self.microbatches
        else:
            arg_mbs, kwarg_mbs = [(t,) for t in pad(inputs)], [{}] * self.microbatches
        targets = [torch.tensor(i) for i in range(self.microbatches)]
        return arg_mbs, kwarg_mbs, targets

    def _first_stage_takes_kwargs(self) -> None:
        """A dict batch reaches the first stage as keyword arguments. torch's schedules hand a micro-batch's
        kwargs to every stage, so a later stage, whose input is the previous stage's output, would get the
        batch's keys too (gpt: `forward(hidden, input_ids=...)`): they are dropped there, once per stage."""
        if getattr(self, "_kwargs_dropped", False):
            return
        for stage in self.stages:
            if not stage.is_first:
                stage.submod.register_forward_pre_hook(_without_kwargs, with_kwargs=True)
        self._kwargs_dropped = True

    def _reinit_on_new_shapes(self, arg_mbs: list, kwarg_mbs: list) -> None:
        """The schedule infers its activation shapes once: a batch of other shapes (another sequence
        length) makes it infer them again."""
        signature = tuple(tuple(t.shape) for t in (*arg_mbs[0], *kwarg_mbs[0].values()) if isinstance(t, torch.Tensor))
        if self._signature is not None and signature != self._signature:
            for flag in ("_stage_forward_initialized", "_stage_backward_initialized", "_stages_forward_initialized",
                         "_stages_backward_initialized"):
                if hasattr(self.schedule, flag):
                    setattr(self.schedule, flag, False)
        self._signature = signature

    def train(self, inputs: Any, labels: torch.Tensor, rows: int, empty: bool, scale: Any) -> torch.Tensor:
        """Forward and backward of one batch (gradients accumulate); this rank's loss sum (0 unless it
        holds the last stage)."""
        self._step = {"labels": labels, "scale": scale, "sums": {}}
        arg_mbs, kwarg_mbs, targets = self._split(inputs, labels, rows, empty)
        self._reinit_on_new_shapes(arg_mbs, kwarg_mbs)
        started, self._timing = time.perf_counter(), True
        try:
            self.schedule.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=targets, return_outputs=False)
        finally:
            self._timing = False
        self.schedule_seconds += time.perf_counter() - started
        sums = self._step["sums"]
        return torch.stack([sums[i] for i in range(self.microbatches)]).sum() if self.is_last and sums \
            else torch.zeros((), device=labels.device)

    @torch.no_grad()
    def forward(self, inputs: Any, labels: torch.Tensor, rows: int) -> Any:
        """The model's output for the batch's real rows on the rank holding the last stage; None elsewhere."""
        self._step = {"labels": labels, "scale": 1.0, "sums": {}}
        arg_mbs, kwarg_mbs, targets = self._split(inputs, labels, rows, empty=False)
        self._reinit_on_new_shapes(arg_mbs, kwarg_mbs)
        if self.schedule_name != "zbv_zero_bubble":
            output = self.schedule.eval(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=targets)
        else:
            # torch 2.14's ZBV runs its backward actions in eval() too ("can't steal_bwd_input if this stage
            # doesn't have backward"): a training step with a zero loss instead, its (zero) gradients dropped
            self._step["scale"] = 0.0
            with torch.enable_grad():
                output = self.schedule.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=targets)
            for p in self.module.parameters():
                p.grad = None
        return output[:rows].detach() if self.is_last else None

    def train_mode(self, training: bool) -> None:
        for m in self.stage_modules:
            m.train(training)

    def micro_batches_follow(self, on: bool) -> None:
        """Cut each batch's own rows into the micro-batches (`on`), rather than the configured batch's rows: a
        ragged batch then runs smaller micro-batches (the schedule infers their shapes again) instead of padded
        ones, and a batch-size finder's candidate runs at its own size."""
        self._follow_batch = on

    def holds_batchnorm(self) -> bool:
        """Whether any stage of the whole model holds a BatchNorm (a collective over the pp group: each rank
        holds only its own stages, and every rank must decide alike)."""
        own = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for s in self.stage_modules for m in s.modules())
        every = [None] * self.pp
        dist.all_gather_object(every, own, group=self.group)
        return any(every)

    def check_batchnorm(self) -> None:
        """A BatchNorm normalises each micro-batch by that micro-batch's own statistics (and counts each in
        num_batches_tracked): with more than one micro-batch per batch the run is not one process's. With one,
        micro_batches_follow keeps padded rows out of its statistics."""
        if self.microbatches > 1:
            raise SpecError(f"parallelism.pp_microbatches: {self.microbatches} with a model holding a BatchNorm: each "
                            "micro-batch would be normalised by its own statistics, unlike one process; use "
                            "parallelism.pp_microbatches=1 with pp_schedule=gpipe, or a norm that does not mix samples "
                            "(LayerNorm, GroupNorm)")

    # --- the optimizer step -------------------------------------------------------------------------

    def sum_over_stages(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sums over the pp group (the last stage's loss and metric sums reach every rank)."""
        flat = torch.stack([v.double() for v in values])
        dist.all_reduce(flat, group=self.group)
        return list(flat.unbind())

    def agree(self, value: Any) -> Any:
        """The value the rank holding the last stage has (None on the others)."""
        every = [None] * self.pp
        dist.all_gather_object(every, value, group=self.group)
        return next(v for v in every if v is not None)

    def average_over_replicas(self) -> None:
        """pp x ddp: each stage's gradients averaged over the data-parallel replicas of that stage (the loss
        scale holds dp degree / units of every replica, as under DDP)."""
        if self.dp_group is None:
            return
        for p in self.module.parameters():
            if p.grad is not None:
                grad = local_tensor_of(p.grad)  # under tp each rank's part of the gradient
                dist.all_reduce(grad, group=self.dp_group)
                grad.div_(self.dp)

    def sync_tied_gradients(self) -> None:
        """A parameter the whole model shares between stages gets the sum of its copies' gradients."""
        named = dict(self.module.named_parameters(remove_duplicate=False))
        for names in self.tied:
            copies = {id(p): p for m in self.stage_modules for n, p in m.named_parameters(remove_duplicate=False)
                      if n in names}
            params = list(copies.values())
            # under tp every copy is split alike (gpt: the vocabulary rows), and the pp group joins ranks of one
            # tp rank: the local parts are summed. A rank holding no copy adds zeros of the part's shape.
            held = next((named[n] for n in names if n in named), None)
            like = local_tensor_of(held.detach()) if held is not None else None
            shape = self._tied_local_shape(names, like)
            own = [p for p in params if p.grad is not None]
            if len(params) == 1 and len(own) == 1 and _summed_in_place(own[0], shape):
                # the one copy's gradient summed where it is: no second whole tensor (GPT-2's tied weight: 147 MiB)
                dist.all_reduce(local_tensor_of(own[0].grad), group=self.group)
                continue
            grad = torch.zeros(shape, device=self.stages[0].device)
            for p in params:
                if p.grad is not None:
                    grad += local_tensor_of(_placed_as_parameter(p.grad, p))
            dist.all_reduce(grad, group=self.group)
            for p in params:
                local = grad.clone() if len(params) > 1 else grad
                p.grad = _like_parameter(local, p)

    def _tied_local_shape(self, names: list[str], like: torch.Tensor | None) -> list[int]:
        """The shape of this rank's part of a tied parameter, agreed over the pp group (a rank holding no copy
        learns it from one that does)."""
        every = [None] * self.pp
        dist.all_gather_object(every, list(like.shape) if like is not None else None, group=self.group)
        return next(s for s in every if s is not None)

    def split_tied_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer state of a parameter every stage holds a copy of (gpt's tied embedding under pp=2) split by
        rows between the pp ranks, each updating its rows and gathering the others' after the step (tied_rows.py)."""
        named = dict(self.module.named_parameters(remove_duplicate=False))
        shared = [(named[own[0]], own) for names, everywhere in zip(self.tied, self.tied_everywhere)
                  if everywhere and (own := [n for n in names if n in named])]
        self.tied_rows = tied_rows.split(optimizer, shared, self.mesh) if shared else None

    def norm_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters whose gradient counts in the global norm: a tied parameter's on its first
        holder only."""
        skip: set[int] = set()
        named = dict(self.module.named_parameters(remove_duplicate=False))
        for g, names in enumerate(self.tied):
            if self.tied_owner[g] != self.pp_rank:
                skip.update(id(named[n]) for n in names if n in named)
        return [p for p in self.module.parameters() if id(p) not in skip]

    def clip_gradients(self, max_norm: float | None, max_value: float | None) -> torch.Tensor:
        """Clipping with the norm over every stage (sum of squares across the pp group); the norm."""
        from runner.engine.parallel.state import full_tensor

        params = [p for p in self.module.parameters() if p.grad is not None]
        if max_value is not None:
            for p in params:  # each rank its part of a tensor-parallel gradient
                local_tensor_of(p.grad).clamp_(-max_value, max_value)
        counted = [p.grad for p in self.norm_parameters() if p.grad is not None]
        # a tensor-parallel gradient's norm is the whole tensor's (a collective over tp): the same on every tp
        # rank, so the sum over the pp group counts each once
        square = torch.stack([full_tensor(torch.linalg.vector_norm(g)) ** 2 for g in counted]).sum() if counted \
            else torch.zeros((), device=self.stages[0].device)
        dist.all_reduce(square, group=self.group)
        norm = square.sqrt()
        if max_norm is not None:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                local_tensor_of(p.grad).mul_(coef)
        return norm

    # --- the whole model on rank 0 (tracking.log_model of a run that writes no checkpoint) -------------------

    def _merged_model(self, parts: list[dict]) -> dict:
        model: dict = {}
        for part in parts:
            model.update(part)
        for names in self.tied:  # every name of a shared parameter, as the whole model's state dict has them
            value = next((model[n] for n in names if n in model), None)
            if value is not None:
                model.update({n: value for n in names})
        return {k: model[k] for k in self.full_keys if k in model}

    def full_model_state(self) -> dict:
        """The whole model's state as full CPU tensors, merged from every stage (a collective)."""
        from runner.engine.parallel.collectives import gather_objects

        from runner.engine.parallel.state import gathered

        own = {k: gathered(v.detach()).cpu() for k, v in self.module.state_dict().items()}
        return self._merged_model(gather_objects(own))


def _summed_in_place(param: torch.Tensor, shape: list[int]) -> bool:
    """Whether `param`'s gradient can be all-reduced where it lies: laid out as the parameter (a DTensor's placed
    alike), its local part a contiguous tensor of the agreed shape and of the dtype the sum is made in otherwise."""
    grad = param.grad
    if hasattr(grad, "placements") and tuple(grad.placements) != tuple(param.placements):
        return False
    local = local_tensor_of(grad)
    return local.is_contiguous() and list(local.shape) == list(shape) and local.dtype == torch.get_default_dtype()


def _placed_as_parameter(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient laid out as its parameter (torch may leave an embedding's gradient replicated while
    the weight is split by rows)."""
    if hasattr(grad, "placements") and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _like_parameter(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A gradient for `param` from this rank's part: a DTensor laid out as the parameter, or the part itself."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _without_kwargs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {}


def _whole_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A stage's DTensor output (sequence-parallel stream) made whole and plain before it is sent."""
    if hasattr(output, "full_tensor"):
        return output.full_tensor()
    return output


def _sequence_split_input(tp_mesh: Any) -> Callable:
    def split(module: nn.Module, args: tuple) -> tuple:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not args or not isinstance(args[0], torch.Tensor) or hasattr(args[0], "device_mesh"):
            return args
        whole = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
        return (whole.redistribute(tp_mesh, [Shard(1)]), *args[1:])
    return split


def _rank_part(model: nn.Module, stages: list[nn.Module]) -> nn.Module:
    """`model` holding only what this rank's stages hold, under the same names: each of their parameters
    and buffers (the stage's own object where a plan copied it), every other part None."""
    keep: dict[str, Any] = {}
    for stage in stages:
        for name, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
            keep.setdefault(name, t)
    _keep_only(model, "", keep)
    return model


def _keep_only(module: nn.Module, prefix: str, keep: dict[str, Any]) -> None:
    for name in list(module._parameters):
        full = prefix + name
        if module._parameters[name] is not None:
            module._parameters[name] = keep.get(full)
    for name in list(module._buffers):
        full = prefix + name
        if module._buffers[name] is not None:
            if full in keep:
                module._buffers[name] = keep[full]
            else:
                del module._buffers[name]
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        inner = prefix + name + "."
        if any(k.startswith(inner) for k in keep):
            _keep_only(child, inner, keep)
        elif any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            module._modules[name] = None  # a stateless part (dropout, an activation) stays: it holds nothing


def step_bubble(busy_seconds: float, step_seconds: float) -> float:
    """The measured bubble of one rank: the share of its schedule time spent outside its own stages'
    compute (waiting for a neighbour, or sending and receiving), 1 - busy / step. With p equal stages and m
    micro-batches the theory for GPipe and 1F1B is (p - 1) / (m + p - 1) (each rank idles p - 1 of the
    m + p - 1 slots of forward and of backward); the interleaved schedules with v stages per rank divide the
    idle slots by v: (p - 1) / (v m + p - 1). The measured figure also holds the communication time, which
    the theory leaves out."""
    return max(0.0, 1.0 - busy_seconds / step_seconds) if step_seconds > 0 else 0.0
