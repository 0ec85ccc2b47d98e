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
  dead round's addresses, and they agree on whether this is a restart;
- every node answers a roll call (RollCall) for as long as the round lasts, so that when the group fails
  the survivors can say which node was lost (its count stopped; node 0's store gone: node 0) and what
  node 0, which holds the run, had kept, or which node's workers failed by themselves.
"""
from __future__ import annotations

import datetime
import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

from runner.specs.run import SpecError

BACKEND = "runner-c10d"
ROUND_ENV = "RUNNER_RDZV_ROUND"              # this round's token, the same on every node
ROUND_INDEX_ENV = "RUNNER_RDZV_ROUND_INDEX"  # rounds before this one (0: the first start), the same on every node
NODE_RANK_PARAM = "runner_node_rank"
RUN_DIR_PARAM = "runner_run_dir"
# a worker's exit code when a collective failed because a peer's process is gone (runner/cli/worker.py): its own
# node is fine, the failure is another node's
PEER_GONE_EXIT = 75
BEAT_S = 0.5            # how often each node answers the roll call
LOST_AFTER_S = 5.0      # a node whose count did not move for this long, after the group failed, is lost


class NodeRankedRendezvous(RendezvousHandler):
    """torch's c10d handler with the node ranks and the round every node agrees on (see the module)."""

    def __init__(self, inner: RendezvousHandler, node_rank: int, timeout_s: float, run_dir: str = "") -> None:
        self._inner, self._node_rank, self._timeout = inner, node_rank, datetime.timedelta(seconds=timeout_s)
        self._run_dir = run_dir
        self._rounds = 0             # rounds this node took part in (node 0's count names the round)
        # the newest round's (several nodes): once a round completed, a failure lost a node, not the address
        self.roll_call: RollCall | None = None

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
        store.set(f"runner/host/{self._node_rank}", socket.gethostname())
        if self._node_rank == 0:
            store.set("runner/run_dir", str(Path(self._run_dir).resolve()) if self._run_dir else "")
            store.set("runner/round", f"{uuid.uuid4().hex}:{self._rounds}")
        try:
            store.wait(["runner/round", "runner/run_dir", *(f"runner/node_rank/{r}" for r in range(nnodes)),
                        *(f"runner/host/{r}" for r in range(nnodes))], self._timeout)
        except Exception:  # DistStoreError (a timeout) or a store gone with its host
            raise SpecError(f"parallelism.node_rank: the {nnodes} nodes that joined did not take every node rank "
                            f"0 to {nnodes - 1} within {self._timeout.total_seconds():g} s; give each node its own") from None
        token, _, index = store.get("runner/round").decode().rpartition(":")
        os.environ[ROUND_ENV], os.environ[ROUND_INDEX_ENV] = token, index  # the workers inherit the agent's environment
        self._rounds += 1
        if self.roll_call is not None:  # the round before: its keys are no longer this round's
            self.roll_call.stop()
        self.roll_call = RollCall(store, self._node_rank, nnodes, self._run_dir) if nnodes > 1 else None
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


class RollCall:
    """Each node adds to its own count in the round's store every BEAT_S seconds, and notes when it last saw each
    other node's count move; node 0 also publishes its newest checkpoint. A background thread of the launcher
    (the elastic agent's process, which outlives its workers), so a node answers for as long as its launcher
    lives, whatever its workers do. Node 0's agent hosts the store: a store gone means node 0 is."""

    def __init__(self, store: object, node_rank: int, nnodes: int, run_dir: str) -> None:
        self.store, self.node_rank, self.nnodes = store, node_rank, nnodes
        self.hosts = {r: store.get(f"runner/host/{r}").decode() for r in range(nnodes)}
        self.run_dir = store.get("runner/run_dir").decode()  # node 0's, which holds the run
        self._own_run_dir = Path(run_dir) if run_dir else None
        self.kept = ""                     # node 0's newest checkpoint, as it last said
        self.failed: dict[int, str] = {}   # nodes whose own workers failed: what they said
        self.moved: dict[int, float] = {}  # monotonic time each node's count was last seen to move
        self._counts: dict[int, int] = {}
        self.store_gone_at: float | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._answer, name="runner-roll-call", daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        while not self._stopping.is_set():
            try:
                self.store.add(f"runner/beat/{self.node_rank}", 1)
                if self.node_rank == 0:
                    self._publish_kept()
                self._read()
            except Exception:  # noqa: BLE001 - the store's host (node 0's launcher) is gone
                if not self._stopping.is_set():
                    self.store_gone_at = time.monotonic()
                return
            self._stopping.wait(BEAT_S)

    def _publish_kept(self) -> None:
        from runner.engine import checkpoint
        from runner.specs.run import SpecError

        try:
            newest = str(checkpoint.resolve(self._own_run_dir)) if self._own_run_dir else ""
        except SpecError:  # none written yet
            newest = ""
        if newest != self.kept:
            self.store.set("runner/kept", newest)
            self.kept = newest

    def _read(self) -> None:
        now = time.monotonic()
        for r in range(self.nnodes):
            count = self.store.add(f"runner/beat/{r}", 0)  # the count, without waiting for a key never set
            if count != self._counts.get(r):
                self._counts[r], self.moved[r] = count, now
            if r not in self.failed and self.store.check([f"runner/failed/{r}"]):
                self.failed[r] = self.store.get(f"runner/failed/{r}").decode()
        if self.node_rank != 0 and self.store.check(["runner/kept"]):
            self.kept = self.store.get("runner/kept").decode()

    def report_failed(self, what: str) -> None:
        """This node's workers failed by themselves: the others name this node rather than a lost one. Node 0
        stays a little (its launcher hosts the store) so the others read it before the store goes."""
        try:
            self.store.set(f"runner/failed/{self.node_rank}", what)
        except Exception:  # noqa: BLE001 - the store is gone: the others see node 0 lost
            return
        if self.node_rank == 0:
            time.sleep(LOST_AFTER_S)

    def lost_nodes(self) -> list[int]:
        """The nodes lost: whose count did not move in the LOST_AFTER_S seconds from now (the call waits them
        out), or node 0 when its store went away before they ended. Node 0 then stays as long again, so the
        other nodes, asking at about the same time, still find its store."""
        asked = time.monotonic()
        self._stopping.wait(LOST_AFTER_S)
        if self.node_rank == 0:
            lost = [r for r in range(1, self.nnodes) if self.moved.get(r, -math.inf) <= asked]
            time.sleep(LOST_AFTER_S)
            return lost
        if self.store_gone_at is not None:
            return [0]
        return [r for r in range(self.nnodes) if r != self.node_rank and self.moved.get(r, -math.inf) <= asked]

    def stop(self) -> None:
        self._stopping.set()


# the handler of the launch running in this process: the launcher asks its roll call which node was lost
current: NodeRankedRendezvous | None = None


def _create(params: RendezvousParameters) -> RendezvousHandler:
    global current
    inner_params = RendezvousParameters(backend="c10d", endpoint=params.endpoint, run_id=params.run_id,
                                        min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                                        local_addr=params.local_addr,
                                        **{k: v for k, v in params.config.items()
                                           if k not in (NODE_RANK_PARAM, RUN_DIR_PARAM)})
    current = NodeRankedRendezvous(registry.create_handler(inner_params), int(params.config[NODE_RANK_PARAM]),
                                   float(params.config.get("join_timeout", 600)), str(params.config.get(RUN_DIR_PARAM, "")))
    return current


def register() -> None:
    """Makes `rdzv_backend=runner-c10d` known to torch's launcher (once per process)."""
    try:
        registry.register(BACKEND, _create)
    except ValueError:  # registered already, by this very function
        pass
