"""Several torchrun ranks and several nodes (torch elastic agents on this host, gloo on CPU), real processes:
who decides for the run directory, where the run lives, an elastic restart across nodes, a lost node."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runner.engine import checkpoint
from tests.runner.engine.test_parallel import free_port

TINY = ["dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.size=400", "dataset.val_fraction=0.1",
        "dataset.test_fraction=0.1", "model=mlp", "model.hidden=[16]", "optimizer=adamw", "dataset.batch_size=16",
        "trainer.progress_bar=off", "trainer.eval_every_epoch=false"]
# long enough to kill a node mid-training: checkpoints every 10 steps, kept
TRAIN = [*TINY, "trainer.max_steps=60", "trainer.checkpoint_every_n_steps=10", "trainer.keep_checkpoints=10",
         "trainer.eval_every_n_steps=30"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def assert_equal_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def start_node(tmp_path: Path, args: list[str], node_rank: int, port: int, run_dir: Path, env: dict | None = None,
               nproc: int = 1, nnodes: int = 2) -> subprocess.Popen:
    """One node: runner's launcher (its own torch elastic agent), in its own session so it dies with its workers."""
    cmd = [sys.executable, "-m", "runner", *args, "parallelism=ddp", f"parallelism.nproc_per_node={nproc}",
           f"parallelism.nnodes={nnodes}", f"parallelism.node_rank={node_rank}", f"parallelism.rdzv_endpoint=127.0.0.1:{port}",
           f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=tmp_path, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(nodes: list[subprocess.Popen], timeout: float = 400) -> list[tuple[int, str, str]]:
    try:
        outs = [n.communicate(timeout=timeout) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                left = workers_of(n.pid)  # torch starts them in sessions of their own
                os.killpg(n.pid, signal.SIGKILL)
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
                n.wait()
    return [(n.returncode, out, err) for n, (out, err) in zip(nodes, outs)]


def workers_of(launcher: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if b"runner.cli.worker" in Path(f"/proc/{p}/cmdline").read_bytes()]


def wait_for(path: Path, nodes: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists() and time.time() < deadline and all(n.poll() is None for n in nodes):
        time.sleep(0.02)
    assert path.exists(), [n.poll() for n in nodes]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """TRAIN on two nodes of one worker each, never stopped."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    port = free_port()
    nodes = [start_node(tmp, [*TRAIN, "tracking=none"], r, port, tmp / f"node{r}") for r in range(2)]
    assert [code for code, _, _ in finish(nodes)] == [0, 0]
    return weights(tmp / "node0")


def _decide_as_rank(rank: int, world: int, run_dir: str, existing: bool) -> str | None:
    """One torchrun rank at the run directory's decision (runner/cli/launch.py), rank 1 arriving late (rank 0 used to
    write spec.yaml meanwhile); runs on the session's two gloo ranks (tests/conftest.py two_ranks). Returns the
    refusal or None."""
    from runner.cli import launch
    from runner.specs.run import SpecError

    os.environ["TORCHELASTIC_RUN_ID"] = "t"
    spec_file = Path(run_dir) / "spec.yaml"
    if rank == 1:
        time.sleep(1)
    try:
        with launch._decided(Path(run_dir), "hydra.run.dir", rank == 0):
            if rank == 0:
                spec_file.write_text("mode: train\n")  # as rank 0 goes on to do
    except SpecError as e:
        return str(e)
    finally:
        os.environ.pop("TORCHELASTIC_RUN_ID", None)
    return None


@pytest.mark.parametrize("existing", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["new", "holds-a-run"])
def test_torchrun_ranks_take_rank_0s_decision_on_the_run_directory(tmp_path: Path, existing: bool, two_ranks) -> None:
    """The fast case (two spawned ranks, no training): rank 1, late, takes rank 0's decision rather than checking
    the directory for itself (it used to, and refused rank 0's fresh spec.yaml: 'already holds a run'); a directory
    that held a run before is refused by rank 0, and rank 1 stops with the same line."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if existing:
        (run_dir / "spec.yaml").write_text("mode: train\n")
    refusals = two_ranks.run(_decide_as_rank, str(run_dir), existing)
    if existing:
        assert refusals[0] == refusals[1] and "already holds a run" in refusals[0]
    else:
        assert refusals == [None, None]
        assert (run_dir / "spec.yaml").exists()


@pytest.mark.slow
def test_torchrun_ranks_follow_rank_0s_decision_on_the_run_directory(tmp_path: Path) -> None:
    """README's one-machine torchrun line, with rank 1 held back until rank 0 has written spec.yaml (the order
    that made rank 1 refuse 'already holds a run'): rank 0 alone decides, and the run trains."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=0", "-m", "runner",
           *TINY, "trainer.max_steps=2", "parallelism=ddp", "tracking=none", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**ENV, "RUNNER_TEST_HOLD_DECISION": "1:3"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already holds a run" not in proc.stderr
    assert "runner: trained 2 optimizer steps" in proc.stdout + proc.stderr
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()


@pytest.mark.slow
@pytest.mark.cluster
def test_two_nodes_sharing_a_run_directory_start_whichever_writes_first(tmp_path: Path) -> None:
    """Node 0 held back until node 1's launcher is well under way (node 1 used to write spec.yaml there first,
    and node 0 then refused its own directory): node 0 alone decides, both train, one spec.yaml names node 0."""
    port = free_port()
    shared = tmp_path / "shared"
    nodes = [start_node(tmp_path, [*TINY, "trainer.max_steps=4", "tracking=none"], r, port, shared,
                        env={"RUNNER_TEST_HOLD_DECISION": "0:8"} if r == 0 else None) for r in range(2)]
    results = finish(nodes)
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert "node_rank: 0" in (shared / "spec.yaml").read_text()
    assert (shared / "checkpoints" / "last.pt").exists()


@pytest.mark.slow
@pytest.mark.cluster
def test_the_run_lives_on_node_0_whichever_node_joins_the_rendezvous_first(tmp_path: Path) -> None:
    """No shared disk: node 1 starts first (torch's c10d rendezvous ranked it first, and the run, checkpoints and
    summary went to node 1's disk); global rank 0 is node 0's first worker, so the run is in node 0's directory."""
    port = free_port()
    node1 = start_node(tmp_path, [*TINY, "trainer.max_steps=4", "tracking=none"], 1, port, tmp_path / "node1")
    time.sleep(3)
    node0 = start_node(tmp_path, [*TINY, "trainer.max_steps=4", "tracking=none"], 0, port, tmp_path / "node0")
    results = finish([node0, node1])
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert (tmp_path / "node0" / "checkpoints" / "last.pt").exists()
    assert (tmp_path / "node0" / "result.yaml").exists()
    assert not (tmp_path / "node1" / "checkpoints").exists()
    assert "runner: trained 4 optimizer steps" in results[0][1] + results[0][2]


def elastic_restart_across_nodes(tmp_path: Path) -> tuple[list[tuple[int, str, str]], Path]:
    """Two nodes, max_restarts=1: node 1's worker is killed (SIGKILL) once node 0 wrote its step-20 checkpoint,
    while node 0's worker is busy outside any collective (stopped for 3 s, as a long step would keep it): node 0's
    agent then learns of the restart from the rendezvous (a membership change, which torch does not count as a
    restart), not from a failed collective of its own worker (which it would count)."""
    port = free_port()
    args = [*TRAIN, "tracking=none", "parallelism.max_restarts=1", "parallelism.rdzv_timeout=60"]
    nodes = [start_node(tmp_path, args, r, port, tmp_path / f"node{r}") for r in range(2)]
    try:
        wait_for(tmp_path / "node0" / "checkpoints" / "step-00000020.pt", nodes)
        victims, busy = workers_of(nodes[1].pid), workers_of(nodes[0].pid)
        assert len(victims) == 1 and len(busy) == 1, (victims, busy)
        os.kill(busy[0], signal.SIGSTOP)
        os.kill(victims[0], signal.SIGKILL)
        time.sleep(3)
        os.kill(busy[0], signal.SIGCONT)
    finally:
        results = finish(nodes, timeout=300)
    return results, tmp_path / "node0"


@pytest.mark.slow
@pytest.mark.cluster
def test_a_worker_killed_on_one_node_restarts_both_nodes_which_finish_as_if_never_stopped(
        tmp_path: Path, uninterrupted: dict) -> None:
    """The restarted round used to wait in gloo's init for 600 s: the node whose worker died looked for the keys
    of round 1, the other node's workers for those of round 0."""
    results, run_dir = elastic_restart_across_nodes(tmp_path)
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    out0 = results[0][1] + results[0][2]
    assert "resuming from the newest checkpoint" in out0
    assert out0.count("runner: trained 60 optimizer steps") == 1
    assert_equal_weights(weights(run_dir), uninterrupted)


@pytest.mark.slow
@pytest.mark.cluster
def test_a_lost_node_is_one_line_naming_it_the_step_and_the_resume_and_the_resume_ends_as_if_never_stopped(
        tmp_path: Path, uninterrupted: dict) -> None:
    port = free_port()
    args = [*TRAIN, "tracking=none", "parallelism.max_restarts=1", "parallelism.rdzv_timeout=10"]
    run_dirs = [tmp_path / f"node{r}" for r in range(2)]
    nodes = [start_node(tmp_path, args, r, port, run_dirs[r]) for r in range(2)]
    try:
        wait_for(run_dirs[0] / "checkpoints" / "step-00000020.pt", nodes)
        lost = workers_of(nodes[1].pid)  # node 1 lost: its agent and its worker (torch starts it in its own session)
        os.killpg(nodes[1].pid, signal.SIGKILL)
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
    finally:
        results = finish(nodes, timeout=300)
    code, out, err = results[0]
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(f"runner: node 1 of 2 (host {socket.gethostname()}) was lost")]
    assert len(lines) == 1, err[-3000:]
    assert "after step " in lines[0] and "did not rejoin within 10 s" in lines[0]
    assert f"trainer.resume={run_dirs[0]}" in lines[0]
    assert "rdzv_endpoint" not in err and "Traceback" not in err
    # resumed by hand as the line says, on every node (node 1 holds no checkpoint: node 0 reads it for both)
    resume_on_every_node(tmp_path, args, [str(run_dirs[r]) for r in range(2)], run_dirs[0], uninterrupted)


def resume_on_every_node(tmp_path: Path, args: list[str], resumes: list[str], run_dir: Path,
                         uninterrupted: dict) -> None:
    """Both nodes resumed by hand (node r with trainer.resume=resumes[r]): they finish, and run_dir's final
    weights equal the uninterrupted run's."""
    port = free_port()
    nodes = [start_node(tmp_path, [*args, f"trainer.resume={resumes[r]}"], r, port, tmp_path / f"resume{r}")
             for r in range(2)]
    results = finish(nodes)
    assert [c for c, _, _ in results] == [0, 0], [e[-2000:] for _, _, e in results]
    assert_equal_weights(weights(run_dir), uninterrupted)


def lose_node(node: subprocess.Popen) -> None:
    """A node lost: its launcher (the agent) and its workers (torch starts them in sessions of their own) killed."""
    workers = workers_of(node.pid)
    os.killpg(node.pid, signal.SIGKILL)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.cluster
def test_without_restarts_the_survivors_of_three_nodes_name_the_lost_node_its_host_and_step(tmp_path: Path) -> None:
    """parallelism.max_restarts=0 (the default): the survivors' workers lose a peer and no restart is left. Both
    survivors used to say 'workers failed: rank 0 (exit code 1)'; with three nodes the line said 'a node'. Now
    each names node 1 and its host, node 0's newest checkpoint (node 2 from node 0's word), and the resume."""
    port = free_port()
    args = [*TRAIN, "tracking=none", "parallelism.rdzv_timeout=30"]
    run_dirs = [tmp_path / f"node{r}" for r in range(3)]
    nodes = [start_node(tmp_path, args, r, port, run_dirs[r], nnodes=3) for r in range(3)]
    try:
        wait_for(run_dirs[0] / "checkpoints" / "step-00000020.pt", nodes)
        lose_node(nodes[1])
    finally:
        results = finish(nodes, timeout=300)
    host = socket.gethostname()
    for r in (0, 2):
        code, out, err = results[r]
        assert code == 1, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("runner: node ")]
        assert len(lines) == 1 and lines[0].startswith(f"runner: node 1 of 3 (host {host}) was lost after step "), err[-3000:]
        step = int(lines[0].split(" was lost after step ")[1].split()[0])
        checkpoint_file = run_dirs[0] / "checkpoints" / f"step-{step:08d}.pt"
        assert checkpoint_file.exists() and f"({checkpoint_file} is kept" in lines[0], lines[0]
        assert lines[0].endswith(f"and no restart was left (parallelism.max_restarts); resume with the same command "
                                 f"on every node plus trainer.resume={run_dirs[0]}"), lines[0]
        assert "Traceback" not in err and "workers failed" not in err


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_losing_node_0_leaves_node_1_one_line_and_the_resume_on_every_node_ends_as_if_never_stopped(
        tmp_path: Path, uninterrupted: dict, max_restarts: int) -> None:
    """Node 0 holds the rendezvous store and global rank 0 (which writes the checkpoints): lost, node 1 learns it
    from the store going away, names it, the checkpoint node 0 last said it kept, and node 0's run directory.
    The resume the line gives, on both nodes, ends with the weights of a run never stopped."""
    port = free_port()
    args = [*TRAIN, "tracking=none", f"parallelism.max_restarts={max_restarts}", "parallelism.rdzv_timeout=10"]
    run_dirs = [tmp_path / f"node{r}" for r in range(2)]
    nodes = [start_node(tmp_path, args, r, port, run_dirs[r]) for r in range(2)]
    try:
        wait_for(run_dirs[0] / "checkpoints" / "step-00000020.pt", nodes)
        # node 0's worker held past its launcher's next roll call (every 0.5 s, which reports the newest
        # checkpoint), as a step longer than that would: then node 0 goes
        [worker] = workers_of(nodes[0].pid)
        os.kill(worker, signal.SIGSTOP)
        time.sleep(2)
        lose_node(nodes[0])
    finally:
        results = finish(nodes, timeout=300)
    code, out, err = results[1]
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("runner: node ")]
    host = socket.gethostname()
    assert len(lines) == 1 and lines[0].startswith(f"runner: node 0 of 2 (host {host}) was lost after step "), err[-3000:]
    newest = sorted((run_dirs[0] / "checkpoints").glob("step-*.pt"))[-1]  # 20, or 30 if it got there before the stop
    assert f"after step {int(newest.stem[5:])} ({newest} is kept on node 0)" in lines[0], lines[0]
    assert lines[0].endswith(f"trainer.resume={run_dirs[0]}") and "Traceback" not in err, lines[0]
    resume = lines[0].rsplit("trainer.resume=", 1)[1]
    resume_on_every_node(tmp_path, args, [resume, resume], run_dirs[0], uninterrupted)


@pytest.mark.slow
@pytest.mark.cluster
def test_without_restarts_a_worker_killed_on_node_1_is_named_by_node_0_not_taken_for_a_lost_node(tmp_path: Path) -> None:
    """Node 1's agent lives on and says its worker was killed; node 0's worker only lost a peer, so node 0 names
    node 1's failure (from the roll call) rather than a lost node or its own 'rank 0 (lost a peer)'."""
    port = free_port()
    args = [*TRAIN, "tracking=none", "parallelism.rdzv_timeout=30"]
    nodes = [start_node(tmp_path, args, r, port, tmp_path / f"node{r}") for r in range(2)]
    try:
        wait_for(tmp_path / "node0" / "checkpoints" / "step-00000020.pt", nodes)
        [victim] = workers_of(nodes[1].pid)
        os.kill(victim, signal.SIGKILL)
    finally:
        results = finish(nodes, timeout=300)
    assert [code for code, _, _ in results] == [1, 1], [err[-2000:] for _, _, err in results]
    assert "runner: workers failed: rank 1 (killed by signal 9)" in results[1][2].splitlines()
    assert f"runner: node 1's workers failed: rank 1 (killed by signal 9) (host {socket.gethostname()}; its log says " \
           "why)" in results[0][2].splitlines(), results[0][2][-3000:]
