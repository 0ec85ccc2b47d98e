"""The rendezvous of runner's launcher: torch's c10d rendezvous, plus what it leaves each node to guess.

torch's c10d rendezvous ranks the nodes by their sorted (host, pid), not by `parallelism.node_rank`, and
tells a worker only its own agent's restart count, which differs between nodes when one node's worker
died (that agent counts a restart, the others a membership change). So after each round of the
rendezvous, in that round's own keys of the rendezvous store (torch prefixes them by round: nothing of
an earlier round is read):

- each node claims its `node_rank`, and the node ranks become the group ranks: global rank 0, which
  writes the run directory, checkpoints and summary, is node 0's first worker, whatever the order
  the nodes joined in (two nodes claiming one rank, or a rank nobody claims, is one line);
- node 0 names the round (a token, and how many rounds came before), and every node exports both to
  its workers: they key their process group's store on the token, so a restarted round never reads a
  dead round's addresses, and they agree on whether this is a restart.
"""
from __future__ import annotations

import datetime
import os
import uuid

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

from runner.spec.run import SpecError

BACKEND = "runner-c10d"
ROUND_ENV = "RUNNER_RDZV_ROUND"              # this round's token, the same on every node
ROUND_INDEX_ENV = "RUNNER_RDZV_ROUND_INDEX"  # rounds before this one (0: the first start), the same on every node
NODE_RANK_PARAM = "runner_node_rank"


class NodeRankedRendezvous(RendezvousHandler):
    """torch's c10d handler with the node ranks and the round every node agrees on (see the module)."""

    def __init__(self, inner: RendezvousHandler, node_rank: int, timeout_s: float) -> None:
        self._inner, self._node_rank, self._timeout = inner, node_rank, datetime.timedelta(seconds=timeout_s)
        self._rounds = 0             # rounds this node took part in (node 0's count names the round)
        self.completed = False       # whether a round ever completed: a later failure lost a node, not the address

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        store, nnodes = info.store, info.world_size
        if self._node_rank >= nnodes:
            raise SpecError(f"parallelism.node_rank: {self._node_rank} is out of range for the {nnodes} nodes that joined; "
                            f"allowed: 0 to {nnodes - 1}")
        claim = store.compare_set(f"runner/node_rank/{self._node_rank}", "", str(info.rank)).decode()
        if claim != str(info.rank):
            raise SpecError(f"parallelism.node_rank: two nodes were started with node_rank={self._node_rank}; give each "
                            f"node its own, 0 to {nnodes - 1}")
        if self._node_rank == 0:
            store.set("runner/round", f"{uuid.uuid4().hex}:{self._rounds}")
        try:
            store.wait(["runner/round", *(f"runner/node_rank/{r}" for r in range(nnodes))], self._timeout)
        except Exception:  # DistStoreError (a timeout) or a store gone with its host
            raise SpecError(f"parallelism.node_rank: the {nnodes} nodes that joined did not take every node rank "
                            f"0 to {nnodes - 1} within {self._timeout.total_seconds():g} s; give each node its own") from None
        token, _, index = store.get("runner/round").decode().rpartition(":")
        os.environ[ROUND_ENV], os.environ[ROUND_INDEX_ENV] = token, index  # the workers inherit the agent's environment
        self._rounds += 1
        self.completed = True
        return RendezvousInfo(store, self._node_rank, nnodes, info.bootstrap_store_info)

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


# the handler of the launch running in this process: the launcher asks it whether a round ever completed
current: NodeRankedRendezvous | None = None


def _create(params: RendezvousParameters) -> RendezvousHandler:
    global current
    inner_params = RendezvousParameters(backend="c10d", endpoint=params.endpoint, run_id=params.run_id,
                                        min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                                        local_addr=params.local_addr,
                                        **{k: v for k, v in params.config.items() if k != NODE_RANK_PARAM})
    current = NodeRankedRendezvous(registry.create_handler(inner_params), int(params.config[NODE_RANK_PARAM]),
                                   float(params.config.get("join_timeout", 600)))
    return current


def register() -> None:
    """Makes `rdzv_backend=runner-c10d` known to torch's launcher (once per process)."""
    try:
        registry.register(BACKEND, _create)
    except ValueError:  # registered already, by this very function
        pass
