"""Memory options under real processes (gloo on CPU): SyncBatchNorm, FSDP2's reshard_after_forward and CPU
offload, activation checkpointing under fsdp. One process group runs several short trainings in turn."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.engine.engine import Engine
from runner.engine.parallel import DistEnv, full_state
from runner.specs.run import RunSpec
from tests.conftest import compose_spec

COMMON = ["dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.size=200", "dataset.val_fraction=0.1",
          "dataset.test_fraction=0.1", "trainer.max_steps=2", "trainer.progress_bar=off", "trainer.eval_every_epoch=false",
          "trainer.memory_estimate=false"]
MLP = [*COMMON, "model=mlp", "model.hidden=[32,32]", "optimizer=adamw"]
CNN = [*COMMON, "model=cnn", "model.channels=[4,8]", "model.norm=true", "optimizer=sgd"]
PER_RANK = 8


def two_rank_runs(cases: dict[str, list[str]], where: Path, two_ranks) -> dict[str, dict]:
    """Each case trained by 2 gloo ranks with dataset.batch_size=PER_RANK: its full model state dict."""
    # composed here: the workers read spec YAML and need not start Hydra
    specs = {name: compose_spec([*overrides, f"dataset.batch_size={PER_RANK}"], where / name).to_yaml()
             for name, overrides in cases.items()}
    two_ranks.run(_train, specs, str(where))
    return {name: torch.load(where / f"{name}.pt") for name in cases}


def _train(rank: int, world: int, specs: dict[str, str], where: str) -> None:
    for name, spec in specs.items():
        engine = Engine(RunSpec.from_yaml(spec), env=DistEnv(rank, world, rank))
        engine.fit()
        model_state, _ = full_state(engine.module, engine.optimizer)
        if rank == 0:
            torch.save(model_state, Path(where) / f"{name}.pt")


def one_process(overrides: list[str], where: Path) -> dict:
    engine = Engine(compose_spec([*overrides, f"dataset.batch_size={2 * PER_RANK}"], where))
    engine.fit()
    return engine.module.state_dict()


def assert_equal(a: dict, b: dict, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=rtol * a[key].abs().max().item(), msg=key)


FAST = {
    # sync_batchnorm with every fsdp memory option at once, and checkpointed BatchNorm blocks; ddp's BatchNorm with
    # and without sync_batchnorm (the composition table's cells); in the slow test below: each fsdp option alone
    "fsdp, sync_batchnorm, every memory option": [*CNN, "parallelism=fsdp", "parallelism.sync_batchnorm=true",
                                                  "parallelism.reshard_after_forward=false", "parallelism.cpu_offload=true",
                                                  "trainer.activation_checkpointing=full"],
    "ddp": [*CNN, "parallelism=ddp"],
    "ddp, sync_batchnorm": [*CNN, "parallelism=ddp", "parallelism.sync_batchnorm=true"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, two_ranks) -> dict[str, dict]:
    where = tmp_path_factory.mktemp("two_ranks")
    return {**two_rank_runs(FAST, where, two_ranks), "one process": one_process(CNN, where / "one"),
            "ddp checkpoint": where / "ddp" / "checkpoints" / "last.pt"}


def assert_statistics_of_one_process(two_ranks: dict, one: dict) -> None:
    stats = [k for k in one if "running" in k]
    assert len(stats) == 4
    assert_equal({k: two_ranks[k] for k in stats}, {k: one[k] for k in stats}, rtol=1e-5)
    assert_equal(two_ranks, one, rtol=1e-4)  # and so the same training


def test_two_ranks_train_like_one_process_with_sync_batchnorm_and_fsdps_memory_options(runs: dict) -> None:
    assert_statistics_of_one_process(runs["fsdp, sync_batchnorm, every memory option"], runs["one process"])


def test_ddp_trains_like_one_process_with_sync_batchnorm_and_keeps_each_ranks_statistics_without(runs: dict) -> None:
    assert_statistics_of_one_process(runs["ddp, sync_batchnorm"], runs["one process"])
    # without sync_batchnorm each rank normalises by its own half of the batch: rank 0's statistics differ
    one = runs["one process"]
    assert not all(torch.allclose(runs["ddp"][k], one[k], rtol=1e-3) for k in one if "running" in k)
    # every tensor a ddp replica holds is saved from rank 0 (ddp broadcasts rank 0's buffers): a mid-run checkpoint
    # that held rank 1's statistics made a resume diverge from the uninterrupted run (DCP spreads them over the ranks)
    from torch.distributed.checkpoint import FileSystemReader

    written_by = {k.fqn: v.relative_path for k, v in
                  FileSystemReader(str(runs["ddp checkpoint"])).read_metadata().storage_data.items()}
    assert set(written_by.values()) == {"__0_0.distcp"}, written_by


@pytest.mark.slow  # in CI: all of them at once in test_two_ranks_train_like_one_process_with_sync_batchnorm_and_fsdps_...
def test_each_fsdp_memory_option_alone(tmp_path: Path, two_ranks) -> None:
    fsdp = [*MLP, "parallelism=fsdp"]
    options = ("parallelism.reshard_after_forward=false", "parallelism.cpu_offload=true",
               "trainer.activation_checkpointing=full", "trainer.activation_checkpointing=selective")
    cases = {"fsdp": fsdp, **{option: [*fsdp, option] for option in options}}
    results = two_rank_runs(cases, tmp_path, two_ranks)
    for option in options:
        assert_equal(results[option], results["fsdp"])
