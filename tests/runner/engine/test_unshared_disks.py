"""Sharded checkpoints on nodes that do not share a disk (runner/engine/unshared_disks.py), on the session's two gloo
ranks: each rank's run directory stands for its node's disk (rank 1's is not rank 0's), as two nodes without a
shared disk run one command with one hydra.run.dir each. The slow two-node tests (tests/runner/cli/test_multinode.py)
run it through real launchers, a killed worker and a lost node."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import compose_spec
from tests.runner.engine.test_parallel import assert_same, final_weights

# fsdp: each rank's shard file holds its own half of every parameter and of the optimizer's moments
TINY = ["dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.size=200", "dataset.val_fraction=0.1",
        "dataset.test_fraction=0.1", "model=mlp", "model.hidden=[16]", "optimizer=adamw", "dataset.batch_size=8",
        "trainer.progress_bar=off", "trainer.eval_every_epoch=false", "trainer.memory_estimate=false",
        "parallelism=fsdp", "parallelism.nproc_per_node=2", "trainer.max_steps=8", "trainer.eval_every_n_steps=2",
        "trainer.checkpoint_every_n_steps=4", "trainer.keep_checkpoints=5", "trainer.test_on=best"]


def _fit(rank: int, world: int, run_dirs: list[str], extra: list[str]) -> None:
    from runner.engine.engine import Engine
    from runner.engine.parallel import DistEnv

    # local rank 0 on each: each rank is its node's first (it writes its node's seed checkpoint in its own disk)
    Engine(compose_spec([*TINY, *extra], Path(run_dirs[rank])), env=DistEnv(rank, world, 0)).fit()


def test_a_run_whose_ranks_do_not_share_a_disk_checkpoints_on_rank_0s_and_resumes_as_if_never_stopped(
        tmp_path: Path, two_ranks) -> None:
    """Each rank wrote its shards into its own run directory: rank 0's checkpoints lacked rank 1's file ('is missing:
    the folder is torn') and rank 1 could not read rank 0's at a resume. Now rank 0's folder holds every shard,
    rank 1's disk keeps none, and a resume from it (rank 1 reading a copy) ends as the uninterrupted run."""
    full = [str(tmp_path / "full0"), str(tmp_path / "full1")]
    two_ranks.run(_fit, full, [])
    assert not (tmp_path / "full1" / "checkpoints").exists()
    step4 = tmp_path / "full0" / "checkpoints" / "step-00000004.pt"
    resumed = [str(tmp_path / "resumed0"), str(tmp_path / "resumed1")]
    two_ranks.run(_fit, resumed, [f"trainer.resume={step4}"])
    assert not (tmp_path / "resumed1" / "checkpoints").exists()
    assert_same(final_weights(tmp_path / "resumed0"), final_weights(tmp_path / "full0"), rtol=0)
