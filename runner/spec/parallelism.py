"""The parallelism group (conf/parallelism/<name>.yaml): how many processes, on how many machines, and how
the model is wrapped (runner/engine/parallel.py, runner/cli/launch.py)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.spec.fields import SpecError, opt


@dataclass(frozen=True)
class ParallelismSpec:
    name: str = opt("single", "parallelism option (conf/parallelism/<name>.yaml): single process, DDP replicas, or FSDP2 shards")
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


def check_parallelism(par: ParallelismSpec) -> None:
    """RunSpec.validate's rules across the parallelism keys."""
    if par.name == "single" and (par.nnodes > 1 or par.nproc_per_node > 1):
        key, value = ("nnodes", par.nnodes) if par.nnodes > 1 else ("nproc_per_node", par.nproc_per_node)
        raise SpecError(f"parallelism.{key}: {value} needs several processes but parallelism=single runs one; "
                        "add parallelism=ddp or parallelism=fsdp")
    if par.sync_batchnorm and par.name == "single":
        raise SpecError("parallelism.sync_batchnorm: true needs several processes but parallelism=single runs one "
                        "(its BatchNorm already sees the whole batch); add parallelism=ddp or parallelism=fsdp")
    fsdp_only = [(k, v) for k, v, default in (("reshard_after_forward", par.reshard_after_forward, True),
                                              ("cpu_offload", par.cpu_offload, False)) if v != default]
    if fsdp_only and par.name != "fsdp":
        key, value = fsdp_only[0]
        raise SpecError(f"parallelism.{key}: {str(value).lower()} is an fsdp option, but parallelism={par.name}; "
                        "use parallelism=fsdp or drop it")
    if par.node_rank >= par.nnodes:
        raise SpecError(f"parallelism.node_rank: {par.node_rank} is out of range; allowed: 0 to nnodes-1 ({par.nnodes - 1})")
    host, _, port = par.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise SpecError(f"parallelism.rdzv_endpoint: {par.rdzv_endpoint!r} is not host:port; e.g. 10.0.0.1:29400")
