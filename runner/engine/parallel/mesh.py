"""Where a process stands: its rank, its device, and its place on the run's device mesh.

The mesh's named dimensions are the parallelism degrees of conf/parallelism (torchtitan's order, outermost
first): pp (pipeline stages), dp_replicate (DDP replicas, or HSDP's replicate dimension), dp_shard (FSDP2
shards), cp (context), tp (tensor). Their product is the number of processes. Everything that means
"the replicas that split the batch" (loader shards, loss scale, global counts, batch checks) reads the
data-parallel degree dp_replicate x dp_shard and this process's dp rank, never the number of processes:
ranks of one model replica (tensor, pipeline or context parallel) see the same samples.

Starting the workers is runner/cli/launch.py's job; this module assumes it runs in one of them.
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runner.engine.parallel.collectives import use_data_parallel_group
from runner.specs.parallelism import PARALLEL_DIMENSIONS as DIMENSIONS, ParallelismSpec, resolve_degrees
from runner.specs.parallelism import nominal_world  # noqa: F401  (exported by runner.engine.parallel)
from runner.specs.run import SpecError

DATA_PARALLEL = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    """The resolved degree of each dimension (no -1 left); their product is `world`."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return math.prod(self.degrees().values())

    @property
    def dp(self) -> int:
        """The data-parallel degree: how many replicas split each global batch."""
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMENSIONS}

    def enabled(self) -> tuple[str, ...]:
        """The dimensions that split anything (degree > 1), outermost first: the mesh's dimensions."""
        return tuple(name for name, degree in self.degrees().items() if degree > 1)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major, as init_device_mesh lays out the ranks)."""
        out = {}
        for name in reversed(DIMENSIONS):
            rank, out[name] = divmod(rank, getattr(self, name))
        return {name: out[name] for name in DIMENSIONS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel replica a rank belongs to: the share of each global batch it reads."""
        at = self.coordinates(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]


def resolve_dims(par: ParallelismSpec, world: int, source: str = "") -> ParallelDims:
    """The degrees of `par` with -1 resolved against `world` processes; their product must be `world`.
    `source` says where the number of processes came from, for the refusal."""
    return ParallelDims(**resolve_degrees(par, world, source))


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: rank 0 of world 1 when not distributed. `world` is every process of
    the run; what splits the batch is `dp_degree` (see the module's docstring). `dims` and `mesh` are
    set by place() (the engine calls it); the mesh is None in one process."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    dims: ParallelDims = field(default_factory=ParallelDims)
    mesh: Any = field(default=None, compare=False)  # torch.distributed.device_mesh.DeviceMesh

    @property
    def distributed(self) -> bool:
        return self.world > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_degree(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    def submesh(self, name: str) -> Any:
        """The 1-D mesh of one dimension ("tp", "pp", "cp", ...) this rank belongs to; None when that
        dimension splits nothing (degree 1) or the run is one process."""
        if self.mesh is None or name not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh[name]


def place(env: DistEnv, par: ParallelismSpec, device: torch.device) -> DistEnv:
    """`env` with the run's parallel dimensions resolved against its processes and, when distributed,
    the device mesh of the enabled ones. Placing an already placed env again returns it."""
    dims = resolve_dims(par, env.world, "its process group")
    needs_mesh = dist.is_initialized() and bool(dims.enabled())
    if env.dims == dims and (env.mesh is not None or not needs_mesh):
        return env
    mesh = None
    if needs_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        names = dims.enabled()
        mesh = init_device_mesh(device.type, tuple(getattr(dims, n) for n in names), mesh_dim_names=names)
    placed = DistEnv(env.rank, env.world, env.local_rank, dims, mesh)
    use_data_parallel_group(data_parallel_group(placed))
    return placed


def data_parallel_group(env: DistEnv) -> Any:
    """The process group of this rank's data-parallel replicas: None (the default group, every process)
    while every process is a replica, a flattened sub-mesh once model parallelism shares the processes."""
    if env.mesh is None or env.dims.dp == env.world:
        return None
    names = tuple(n for n in DATA_PARALLEL if getattr(env.dims, n) > 1)
    if not names:  # one replica on every process (tp/pp/cp only): each rank's sums are its replica's alone
        group, _ = dist.new_subgroups(group_size=1)  # collective: every rank makes every one-rank group
        return group
    sub = env.mesh[names]
    return (sub._flatten("dp") if len(names) > 1 else sub).get_group()


def in_torchrun() -> bool:
    """True inside a worker started by torchrun or torch's elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def init_process_group(device_type: str, timeout_s: float = 600) -> DistEnv:
    """Join the group the elastic agent set up (env://): nccl on CUDA, gloo on CPU."""
    env = DistEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=timeout, **_store_of_this_attempt(env, timeout))
    return env


def _store_of_this_attempt(env: DistEnv, timeout: datetime.timedelta) -> dict:
    """The agent's store, with keys of this restart round only.

    torch's elastic agent (c10d rendezvous) keeps one TCPStore for all rounds, and env:// adds no
    per-round prefix (torch assumes a fresh store per round). After a restart, a rank could then read a
    dead worker's gloo address or NCCL id left from the previous round and fail with "Connection
    refused", costing every restart the agent had. A prefix per round keeps the rounds apart.

    The round is the token runner's launcher gives every node's workers for it (runner/cli/rendezvous.py):
    torch's restart count is each agent's own, and after one node's worker died the nodes' counts differ.
    Under plain torchrun (no token) the restart count serves one node."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world, is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("RUNNER_RDZV_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"runner/round_{attempt}", store), "rank": env.rank, "world_size": env.world}


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SpecError("trainer.device: 'cuda' was asked for but no CUDA GPU is visible; use trainer.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)
