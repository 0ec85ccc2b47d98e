"""The parallelism group (conf/parallelism/<name>.yaml): how many processes, on how many machines, and how
the model is wrapped (runner/engine/parallel/, runner/cli/launch.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from runner.spec.fields import Component, SpecError, component_dict, opt


@dataclass(frozen=True)
class PlanSpec(Component):
    """A user's own tensor- or pipeline-parallel plan: a function named by `_target_` and its own arguments.
    tp_plan: fn(model, tp_mesh, **params) parallelizes the model in place (runner/engine/parallel/tensor.py);
    pp_plan: fn(model, stage_index, num_stages, **params) -> the stage's module, parameter names kept as in
    the whole model (runner/engine/parallel/pipeline.py)."""

    target: str = ""
    params: dict = field(default_factory=dict)

    def __to_plain__(self) -> dict:
        return {"_target_": self.target, **self.params}

    @classmethod
    def parse(cls, data: Any, key: str) -> "PlanSpec":
        data = component_dict(data, key)
        return cls(target=data.pop("_target_"), params=data)


# torch.distributed.pipelining's schedules by the name a user types; the multi-stage ones hold
# pp_stages_per_rank > 1 stages on each rank
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")


@dataclass(frozen=True)
class ParallelismSpec:
    name: str = opt("single", "parallelism option (conf/parallelism/<name>.yaml): single process, DDP replicas, FSDP2 "
                              "shards, or HSDP (shards replicated)")
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
    nproc_per_node: int = opt(1, "worker processes per node (one device each)", gt=0)
    nnodes: int = opt(1, "machines taking part; each runs the same command", gt=0)
    node_rank: int = opt(0, "this machine's index; node 0 hosts the rendezvous store", ge=0)
    rdzv_endpoint: str = opt("127.0.0.1:29400", "host:port of the c10d rendezvous (node 0's address) when nnodes > 1")
    rdzv_timeout: float = opt(120.0, "seconds to wait for every node to join before giving up", gt=0)
    max_restarts: int = opt(0, "elastic restarts of the worker group after a worker dies (resumes from the last checkpoint)", ge=0)
    sync_batchnorm: bool = opt(False, "BatchNorm statistics over the global batch of all ranks (SyncBatchNorm); ddp/fsdp only")
    reshard_after_forward: bool = opt(True, "fsdp: free each block's gathered parameters after its forward (false: keep "
                                            "them until the backward, more memory, one all-gather less per step)")
    cpu_offload: bool = opt(False, "fsdp: keep parameters, gradients and optimizer state on the CPU (the optimizer "
                                   "steps there); for a model that does not fit on the devices otherwise")


# the parallel dimensions, outermost first (torchtitan's order: consecutive ranks differ in tp, so a
# tensor-parallel group stays within a node); runner/engine/parallel/mesh.py lays the ranks out by it
PARALLEL_DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def check_degrees(par: ParallelismSpec) -> None:
    """What can be said of the degrees before the number of processes is known."""
    for name in PARALLEL_DIMENSIONS:
        degree = getattr(par, name)
        if degree == 0 or degree < -1:
            raise SpecError(f"parallelism.{name}: {degree} is not a degree; allowed: a positive number of processes, "
                            "or -1 for the processes the other degrees leave")
    rest = [name for name in PARALLEL_DIMENSIONS if getattr(par, name) == -1]
    if len(rest) > 1:
        raise SpecError(f"parallelism.{rest[1]}: -1, but parallelism.{rest[0]} is -1 already; at most one degree "
                        "takes the processes left")


def check_parallelism(par: ParallelismSpec) -> None:
    """RunSpec.validate's rules across the parallelism keys."""
    check_degrees(par)
    if par.name == "single" and (par.nnodes > 1 or par.nproc_per_node > 1):
        key, value = ("nnodes", par.nnodes) if par.nnodes > 1 else ("nproc_per_node", par.nproc_per_node)
        raise SpecError(f"parallelism.{key}: {value} needs several processes but parallelism=single runs one; "
                        "add parallelism=ddp or parallelism=fsdp")
    if par.sync_batchnorm and par.name == "single":
        raise SpecError("parallelism.sync_batchnorm: true needs several processes but parallelism=single runs one "
                        "(its BatchNorm already sees the whole batch); add parallelism=ddp or parallelism=fsdp")
    split = [(k, getattr(par, k)) for k in PARALLEL_DIMENSIONS if getattr(par, k) > 1]
    if par.name == "single" and split:
        raise SpecError(f"parallelism.{split[0][0]}: {split[0][1]} needs several processes but parallelism=single "
                        "runs one; add parallelism=ddp, fsdp or hsdp")
    fsdp_only = [(k, v) for k, v, default in (("reshard_after_forward", par.reshard_after_forward, True),
                                              ("cpu_offload", par.cpu_offload, False)) if v != default]
    if fsdp_only and par.dp_shard == 1:  # options of a sharded wrap: fsdp, hsdp
        key, value = fsdp_only[0]
        raise SpecError(f"parallelism.{key}: {str(value).lower()} is an fsdp option, but parallelism={par.name}; "
                        "use parallelism=fsdp or drop it")
    if par.node_rank >= par.nnodes:
        raise SpecError(f"parallelism.node_rank: {par.node_rank} is out of range; allowed: 0 to nnodes-1 ({par.nnodes - 1})")
    host, _, port = par.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise SpecError(f"parallelism.rdzv_endpoint: {par.rdzv_endpoint!r} is not host:port; e.g. 10.0.0.1:29400")
