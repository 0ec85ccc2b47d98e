"""The parallelism group (conf/parallelism/<name>.yaml): how many processes, on how many machines, and how
the model is wrapped (runner/engine/parallel/, runner/cli/launch.py)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from runner.specs.fields import Component, SpecError, opt


@dataclass(frozen=True)
class PlanSpec(Component):
    """A user's own tensor- or pipeline-parallel plan: a function named by `_target_` and its own arguments.
    tp_plan: fn(model, tp_mesh, **params) parallelizes the model in place (runner/engine/parallel/tensor.py);
    pp_plan: fn(model, stage_index, num_stages, **params) -> the stage's module, parameter names kept as in
    the whole model (runner/engine/parallel/pipeline.py). A block outside the stage becomes nn.Identity, so the
    model must add each block's residual inside the block: `x = x + block(x)` in the model's forward would pass
    x + x through a stage that lacks the block, and no check can see it."""

    target: str = ""
    params: dict = field(default_factory=dict)


# torch.distributed.pipelining's schedules by the name a user types; the multi-stage ones hold
# pp_stages_per_rank > 1 stages on each rank
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")


@dataclass(frozen=True)
class ParallelismSpec:
    name: str = opt("single", "parallelism option (conf/parallelism/<name>.yaml): single process (or one model replica "
                              "on tp x pp x cp processes), DDP replicas, FSDP2 shards, or HSDP (shards replicated)")
    # the parallel dimensions (runner/engine/parallel/mesh.py): their product is the number of processes
    dp_replicate: int = opt(-1, "data-parallel replicas (DDP; with dp_shard > 1, HSDP's replicate dimension); "
                               "-1: the processes the other degrees leave", ge=-1)
    dp_shard: int = opt(1, "data-parallel shards (FSDP2 fully_shard); -1: the processes the other degrees leave", ge=-1)
    tp: int = opt(1, "tensor-parallel degree: each layer's weights split across this many processes (within a node)", ge=-1)
    pp: int = opt(1, "pipeline-parallel degree: the model cut into this many consecutive stages", ge=-1)
    cp: int = opt(1, "context-parallel degree: each sequence split across this many processes (gpt attention, CUDA)", ge=-1)
    # tensor parallelism (tp > 1)
    tp_plan: Optional[PlanSpec] = opt(None, "a tensor-parallel plan {_target_: my_pkg.plan, ...}: fn(model, tp_mesh); "
                                            "null: the model's own (gpt, vit, a HuggingFace model's tp_plan)")
    sequence_parallel: bool = opt(True, "tp: norms and dropout run on sequence shards (less activation memory)")
    loss_parallel: bool = opt(True, "tp: the vocabulary projection stays sharded into the loss (no full logits)")
    # pipeline parallelism (pp > 1)
    pp_plan: Optional[PlanSpec] = opt(None, "a pipeline plan {_target_: my_pkg.stage, ...}: fn(model, stage_index, "
                                            "num_stages) -> the stage's module; null: the model's own (gpt, vit: by blocks)")
    pp_schedule: Literal[PP_SCHEDULES] = opt("1f1b", "pipeline schedule: " + ", ".join(PP_SCHEDULES))
    pp_microbatches: int = opt(-1, "micro-batches each batch is cut into for the pipeline; -1: the number of stages", ge=-1)
    pp_stages_per_rank: int = opt(-1, "stages each pipeline rank holds; -1: 1, or 2 for the multi-stage schedules "
                                      "(" + ", ".join(MULTI_STAGE_SCHEDULES) + ")", ge=-1)
    nproc_per_node: int = opt(1, "worker processes per node (one device each); under single: tp x pp x cp, this key 1", gt=0)
    nnodes: int = opt(1, "machines taking part; each runs the same command", gt=0)
    node_rank: int = opt(0, "this machine's index; node 0 hosts the rendezvous store", ge=0)
    rdzv_endpoint: str = opt("127.0.0.1:29400", "host:port of the c10d rendezvous (node 0's address) when nnodes > 1")
    rdzv_timeout: float = opt(120.0, "seconds to wait for every node to join before giving up", gt=0)
    max_restarts: int = opt(0, "elastic restarts of the worker group after a worker dies (resumes from the last checkpoint)", ge=0)
    sync_batchnorm: bool = opt(False, "BatchNorm statistics over the global batch of all ranks (SyncBatchNorm); ddp/fsdp only")
    reshard_after_forward: bool = opt(True, "fsdp: free each block's gathered parameters after its forward (false: keep "
                                            "them until the backward, more memory, one all-gather less per step)")
    meta_init: Literal["auto", True, False] = opt(
        "auto", "build the model on the meta device and materialise only this rank's shards, their initial values "
                "those of one process (a seed checkpoint no rank holds whole), where the run shards the model (dp_shard, "
                "tp or pp > 1); auto: so, and a model whose constructor cannot run on meta is built whole on every "
                "rank (said in one line); true: a model that cannot is refused; false: every rank builds the whole model")
    cpu_offload: bool = opt(False, "fsdp: keep parameters, gradients and optimizer state on the CPU (the optimizer "
                                   "steps there); for a model that does not fit on the devices otherwise")


# the parallel dimensions, outermost first (torchtitan's order: consecutive ranks differ in tp, so a
# tensor-parallel group stays within a node); runner/engine/parallel/mesh.py lays the ranks out by it
PARALLEL_DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


# schedules that hold exactly one stage on each pipeline rank
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
MODEL_PARALLEL = ("pp", "cp", "tp")  # the dimensions whose ranks hold parts of one model replica


def check_degrees(par: ParallelismSpec) -> None:
    """What can be said of the degrees before the number of processes is known."""
    for name in PARALLEL_DIMENSIONS:
        degree = getattr(par, name)
        if degree == 0 or degree < -1:
            raise SpecError(f"parallelism.{name}: {degree} is not a degree; allowed: a positive number of processes, "
                            "or -1 for the processes the other degrees leave")
    if par.name == "single":
        for name in MODEL_PARALLEL:
            if getattr(par, name) == -1:
                raise SpecError(f"parallelism.{name}: -1 takes the processes the other degrees leave, but "
                                "parallelism=single starts tp x pp x cp processes; give a number of processes")
    rest = [name for name in PARALLEL_DIMENSIONS if getattr(par, name) == -1]
    if len(rest) > 1:
        raise SpecError(f"parallelism.{rest[1]}: -1, but parallelism.{rest[0]} is -1 already; at most one degree "
                        "takes the processes left")


def nominal_world(par: ParallelismSpec) -> int:
    """The processes the launcher starts for `par`: nproc_per_node x nnodes; under single, one process per
    model-parallel rank (tp x pp x cp on this node, the data-parallel degree 1), so that
    `parallelism.tp=2` alone runs one model on two processes."""
    if par.name == "single":
        return math.prod(max(1, getattr(par, name)) for name in MODEL_PARALLEL)
    return par.nproc_per_node * par.nnodes


def world_source(par: ParallelismSpec) -> str:
    """Where nominal_world's number comes from, for a refusal."""
    if par.name == "single":
        return "parallelism=single starts tp x pp x cp"
    return f"nproc_per_node={par.nproc_per_node} x nnodes={par.nnodes}"


def resolve_degrees(par: ParallelismSpec, world: int, source: str = "") -> dict[str, int]:
    """The degrees of `par` with -1 resolved against `world` processes; their product must be `world`.
    `source` says where the number of processes came from, for the refusal."""
    check_degrees(par)
    given = {name: getattr(par, name) for name in PARALLEL_DIMENSIONS}
    known = math.prod(d for d in given.values() if d != -1)
    shown = " x ".join(f"{name}={d}" for name, d in given.items() if d != 1) or "every degree 1"
    where = f" ({source})" if source else ""
    rest = next((name for name, d in given.items() if d == -1), None)
    if rest is not None:
        if world % known:
            raise SpecError(f"parallelism.{rest}: -1 takes the processes the other degrees leave, but {world} "
                            f"process(es){where} do not divide by {known} ({shown}); make the degrees' product {world}")
        given[rest] = world // known
    elif known != world:
        raise SpecError(f"parallelism: the degrees make {known} process(es) ({shown}) but the run has {world}{where}; "
                        f"their product must equal the number of processes (or set one degree to -1 for the rest)")
    return given


def check_parallelism(par: ParallelismSpec, batch_size: Optional[int] = None, device: Optional[str] = None) -> None:
    """RunSpec.validate's rules across the parallelism keys (with the per-rank batch size and the device
    where the rule needs them). What needs the model is runner/cli/preflight_model.py's check; the devices
    torch sees, runner/cli/launch.py's check_parallel."""
    check_degrees(par)
    if par.name == "single" and (par.nnodes > 1 or par.nproc_per_node > 1):
        key, value = ("nnodes", par.nnodes) if par.nnodes > 1 else ("nproc_per_node", par.nproc_per_node)
        raise SpecError(f"parallelism.{key}: {value} needs several processes but parallelism=single runs one; "
                        "add parallelism=ddp or parallelism=fsdp")
    if par.sync_batchnorm and par.name == "single" and nominal_world(par) == 1:
        raise SpecError("parallelism.sync_batchnorm: true needs several processes but parallelism=single runs one "
                        "(its BatchNorm already sees the whole batch); add parallelism=ddp or parallelism=fsdp")
    # under single the processes are the model-parallel ones (nominal_world): a data-parallel degree needs a preset
    split = [(k, getattr(par, k)) for k in ("dp_replicate", "dp_shard") if getattr(par, k) > 1]
    if par.name == "single" and split:
        raise SpecError(f"parallelism.{split[0][0]}: {split[0][1]} needs several processes but parallelism=single "
                        "runs one; add parallelism=ddp, fsdp or hsdp")
    fsdp_only = [(k, v) for k, v, default in (("reshard_after_forward", par.reshard_after_forward, True),
                                              ("cpu_offload", par.cpu_offload, False)) if v != default]
    if fsdp_only and par.dp_shard == 1:  # options of a sharded wrap: fsdp, hsdp
        key, value = fsdp_only[0]
        raise SpecError(f"parallelism.{key}: {str(value).lower()} is an fsdp option, but parallelism={par.name}; "
                        "use parallelism=fsdp or drop it")
    if par.node_rank >= par.nnodes and par.nnodes == 1:  # a machine of several, but nnodes left at one: nnodes is wrong
        raise SpecError(f"parallelism.nnodes: 1, but parallelism.node_rank={par.node_rank} names machine {par.node_rank} "
                        f"of several; set parallelism.nnodes to the number of machines (at least {par.node_rank + 1})")
    if par.node_rank >= par.nnodes:
        raise SpecError(f"parallelism.node_rank: {par.node_rank} is out of range; allowed: 0 to nnodes-1 ({par.nnodes - 1})")
    host, _, port = par.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise SpecError(f"parallelism.rdzv_endpoint: {par.rdzv_endpoint!r} is not host:port; e.g. 10.0.0.1:29400")
    # a torchrun the user started decides the processes itself: the process group is checked when it forms
    # (runner/engine/parallel/mesh.py's place); otherwise the launcher starts nominal_world processes
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        resolve_degrees(par, nominal_world(par), world_source(par))
    check_model_parallel_options(par, batch_size, device)


def check_model_parallel_options(par: ParallelismSpec, batch_size: Optional[int], device: Optional[str]) -> None:
    """The tensor-, pipeline- and context-parallel keys: each needs its degree, the schedule its stages per
    rank, the micro-batches a batch to cut. A key set for a dimension that splits nothing is refused (a
    user who sets tp_plan and leaves tp=1 most likely forgot tp)."""
    tp_keys = [(k, v) for k, v, default in (("tp_plan", par.tp_plan, None),
                                            ("sequence_parallel", par.sequence_parallel, True),
                                            ("loss_parallel", par.loss_parallel, True)) if v != default]
    if tp_keys and par.tp == 1:
        key, value = tp_keys[0]
        shown = "set" if key == "tp_plan" else str(value).lower()
        raise SpecError(f"parallelism.{key}: {shown}, but parallelism.tp=1 splits no layer; set parallelism.tp "
                        "(e.g. 2) or drop it")
    pp_keys = [(k, v) for k, v, default in (("pp_plan", par.pp_plan, None), ("pp_schedule", par.pp_schedule, "1f1b"),
                                            ("pp_microbatches", par.pp_microbatches, -1),
                                            ("pp_stages_per_rank", par.pp_stages_per_rank, -1)) if v != default]
    if pp_keys and par.pp == 1:
        key, value = pp_keys[0]
        shown = "set" if key == "pp_plan" else value
        raise SpecError(f"parallelism.{key}: {shown}, but parallelism.pp=1 cuts no pipeline; set parallelism.pp "
                        "(e.g. 2) or drop it")
    stages = par.pp_stages_per_rank
    if stages != -1:
        if par.pp_schedule in SINGLE_STAGE_SCHEDULES and stages != 1:
            raise SpecError(f"parallelism.pp_stages_per_rank: {stages}, but pp_schedule={par.pp_schedule} holds one "
                            f"stage per rank; use 1 (or -1), or a multi-stage schedule: {', '.join(MULTI_STAGE_SCHEDULES)}")
        if par.pp_schedule == "zbv_zero_bubble" and stages != 2:
            raise SpecError(f"parallelism.pp_stages_per_rank: {stages}, but pp_schedule=zbv_zero_bubble holds exactly "
                            "2 stages per rank (a V); use 2 (or -1)")
        if par.pp_schedule in MULTI_STAGE_SCHEDULES and stages == 1:
            raise SpecError(f"parallelism.pp_stages_per_rank: 1, but pp_schedule={par.pp_schedule} holds several "
                            "stages per rank; use 2 or more (or -1 for 2), or pp_schedule=1f1b or gpipe")
    if par.pp > 1:
        check_pipeline_keys(par, batch_size)
    if par.cp != 1 and device == "cpu":
        raise SpecError(f"parallelism.cp: {par.cp}, but context parallelism needs CUDA (torch's context-parallel "
                        "attention runs on GPUs) and trainer.device=cpu; use trainer.device=cuda or parallelism.cp=1")
    # sync_batchnorm under tp, pp or cp: the composition table's cells (runner/specs/composition.py)


def pp_stages_per_rank(par: ParallelismSpec) -> int:
    """pp_stages_per_rank with -1 resolved: 1 for gpipe/1f1b, 2 for the multi-stage schedules."""
    if par.pp_stages_per_rank != -1:
        return par.pp_stages_per_rank
    return 2 if par.pp_schedule in MULTI_STAGE_SCHEDULES else 1


def pp_microbatches(par: ParallelismSpec) -> int:
    """pp_microbatches with -1 resolved: the number of stages."""
    return par.pp_microbatches if par.pp_microbatches != -1 else par.pp * pp_stages_per_rank(par)


def check_pipeline_keys(par: ParallelismSpec, batch_size: Optional[int]) -> None:
    """The micro-batches against the batch and the schedule, with -1 resolved: what torch's schedules would
    refuse only once built, in every worker (runner/engine/parallel/pipeline.py)."""
    micro, given = pp_microbatches(par), par.pp_microbatches != -1
    shown = f"{micro}" if given else f"-1 (one per stage: {micro})"
    if batch_size is not None and micro > batch_size:
        raise SpecError(f"parallelism.pp_microbatches: {shown} micro-batches cannot be cut from a batch of {batch_size} "
                        f"(dataset.batch_size, per data-parallel rank); allowed: 1 to {batch_size}, or a larger batch")
    if par.pp_schedule == "1f1b" and micro < par.pp:
        raise SpecError(f"parallelism.pp_microbatches: {shown} with pp_schedule=1f1b and parallelism.pp={par.pp}: 1F1B "
                        f"needs at least one micro-batch per stage; allowed: {par.pp} or more, or pp_schedule=gpipe")
    if par.pp_schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, micro // par.pp)
        if micro % rounds:
            raise SpecError(f"parallelism.pp_microbatches: {shown} with pp_schedule={par.pp_schedule} and parallelism.pp="
                            f"{par.pp}: the micro-batches must be a multiple of their {rounds} rounds (micro-batches // pp); "
                            f"allowed: e.g. {rounds * par.pp} or {par.pp}")
