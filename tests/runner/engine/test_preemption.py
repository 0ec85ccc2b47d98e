"""runner/addons/stop_vote.py with runner/engine/preemption.py: the stop vote that makes every rank stop at the same step."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, SIGNAL_AT = 400, 30


def _rank(rank: int, port: int, out: str) -> None:
    from runner.addons.stop_vote import StopVote
    from runner.engine import preemption

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    collectives = 0
    real_all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        nonlocal collectives
        collectives += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    vote, stop = StopVote(distributed=True, every_s=0.05), None
    with preemption.handled(), preemption.at_step_boundaries():
        for step in range(1, STEPS + 1):
            time.sleep(0.001 * (1 + rank))  # ranks run at different speeds between boundaries
            if rank == 1 and step == SIGNAL_AT:
                os.kill(os.getpid(), signal.SIGTERM)  # noted, not raised: the loop stops where all agree
            if vote.agreed():
                stop = step
                break
    Path(out, f"rank{rank}.json").write_text(json.dumps({"stop": stop, "collectives": collectives}))
    dist.destroy_process_group()


def test_ranks_vote_every_few_steps_yet_all_stop_at_one_step_soon_after_a_signal_to_one_of_them(tmp_path: Path) -> None:
    """A signal to one rank stops both at the same step, within a vote interval (about every_s seconds of
    steps) of its arrival; the ranks all-reduce at few of the steps, not at each one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children reuse the imported torch (spawning two fresh interpreters costs ~10 s of CPU)
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, start_method="fork")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["stop"] == ranks[1]["stop"] is not None
    # the slower rank's 2 ms steps (plus the vote) make an interval of at most 25 steps
    assert SIGNAL_AT <= ranks[0]["stop"] <= SIGNAL_AT + 26
    assert ranks[0]["collectives"] == ranks[1]["collectives"] <= ranks[0]["stop"] // 5


@pytest.mark.slow  # a real process training (about 40 s on a loaded 2-core machine)
def test_a_preemption_after_the_run_finished_leaves_it_finished_and_exits_0(tmp_path: Path,
                                                                            migrated_mlflow_store: Path) -> None:
    """SIGTERM once the run ended FINISHED (its summary not yet printed) stops nothing: exit 0, no "marked
    KILLED" line (SLURM would mark the job FAILED), the MLflow run FINISHED, one line saying so."""
    import shutil
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from tests.conftest import REPO

    db = tmp_path / "mlflow.db"
    shutil.copy(migrated_mlflow_store, db)
    out = subprocess.run([sys.executable, str(REPO / "tests" / "runner" / "kill_at.py"), "run_finished:TERM", "1",
                          "trainer.max_steps=3", "trainer.progress_bar=off", "trainer.memory_estimate=false",
                          f"hydra.run.dir={tmp_path / 'run'}", f"tracking.uri=sqlite:///{db}",
                          f"tracking.artifact_root={tmp_path / 'artifacts'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "KILLED" not in out.stderr + out.stdout
    assert "SIGTERM after the run finished: it stays FINISHED, nothing to stop" in out.stderr + out.stdout
    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"


def test_slurm_requeue_is_a_boolean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """trainer.slurm_requeue (on by default: a stopped run inside a SLURM job requeues it) takes true or false,
    anything else is one line before Hydra starts."""
    from tests.runner.test_bad_input import PRE, run_in_process

    code, _, err = run_in_process(["trainer.slurm_requeue=maybe"], tmp_path, PRE, monkeypatch, capsys)
    assert (code, err.strip().splitlines()) == (2, ["error: trainer.slurm_requeue: 'maybe' is not a boolean; use true or false"])
