"""Memory options under real processes (gloo on CPU): SyncBatchNorm, FSDP2's reshard_after_forward and CPU
offload, activation checkpointing under fsdp. One process group runs several short trainings in turn."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from runner.engine import Engine
from runner.parallel import DistEnv, full_state
from tests.conftest import compose_spec
from tests.runner.test_parallel import free_port

COMMON = ["dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.size=200", "dataset.val_fraction=0.1",
          "dataset.test_fraction=0.1", "trainer.max_steps=4", "trainer.progress_bar=off", "trainer.eval_every_epoch=false",
          "trainer.memory_estimate=false"]
MLP = [*COMMON, "model=mlp", "model.hidden=[32,32]", "optimizer=adamw"]
CNN = [*COMMON, "model=cnn", "model.channels=[4,8]", "model.norm=true", "optimizer=sgd"]
PER_RANK = 8


def two_rank_runs(cases: dict[str, list[str]], where: Path) -> dict[str, dict]:
    """Each case trained by 2 gloo ranks with dataset.batch_size=PER_RANK: its full model state dict."""
    port, ctx = free_port(), mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(rank, port, cases, str(where))) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    return {name: torch.load(where / f"{name}.pt") for name in cases}


def _worker(rank: int, port: int, cases: dict[str, list[str]], where: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo")
    for name, overrides in cases.items():
        engine = Engine(compose_spec([*overrides, f"dataset.batch_size={PER_RANK}"], Path(where) / name),
                        env=DistEnv(rank, 2, rank))
        engine.fit()
        model_state, _ = full_state(engine.module, engine.optimizer)
        if rank == 0:
            torch.save(model_state, Path(where) / f"{name}.pt")
    torch.distributed.destroy_process_group()


def one_process(overrides: list[str], where: Path) -> dict:
    engine = Engine(compose_spec([*overrides, f"dataset.batch_size={2 * PER_RANK}"], where))
    engine.fit()
    return engine.module.state_dict()


def assert_equal(a: dict, b: dict, rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=rtol * a[key].abs().max().item(), msg=key)


FAST = {
    "ddp, sync_batchnorm": [*CNN, "parallelism=ddp", "parallelism.sync_batchnorm=true"],
    # every fsdp memory option at once in CI (each alone in the slow test below), with checkpointed BatchNorm blocks
    "fsdp, every memory option": [*CNN, "parallelism=fsdp", "parallelism.sync_batchnorm=true",
                                  "parallelism.reshard_after_forward=false", "parallelism.cpu_offload=true",
                                  "trainer.activation_checkpointing=full"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    where = tmp_path_factory.mktemp("two_ranks")
    return {**two_rank_runs(FAST, where), "one process": one_process(CNN, where / "one")}


@pytest.mark.parametrize("case", list(FAST))
def test_sync_batchnorm_gives_two_ranks_the_statistics_of_one_process_over_the_global_batch(runs: dict, case: str) -> None:
    one, synced = runs["one process"], runs[case]
    stats = [k for k in one if "running" in k]
    assert len(stats) == 4
    assert_equal({k: synced[k] for k in stats}, {k: one[k] for k in stats}, rtol=1e-5)
    assert_equal(synced, one, rtol=1e-4)  # and so the same training, whatever fsdp's memory options


@pytest.mark.slow  # in CI: all together in test_sync_batchnorm_gives_two_ranks_..._global_batch[fsdp, every memory option]
def test_each_fsdp_memory_option_alone_trains_the_default_weights_and_batchnorm_differs_unsynced(tmp_path: Path) -> None:
    fsdp = [*MLP, "parallelism=fsdp"]
    cases = {"fsdp": fsdp, "ddp": [*CNN, "parallelism=ddp"], **{option: [*fsdp, option] for option in (
        "parallelism.reshard_after_forward=false", "parallelism.cpu_offload=true",
        "trainer.activation_checkpointing=full", "trainer.activation_checkpointing=selective")}}
    results = two_rank_runs(cases, tmp_path)
    for option in cases:
        if option != "ddp":
            assert_equal(results[option], results["fsdp"])
    # without sync_batchnorm each rank normalises by its own half of the batch: rank 0's statistics differ
    one = one_process(CNN, tmp_path / "cnn")
    assert not all(torch.allclose(results["ddp"][k], one[k], rtol=1e-3) for k in one if "running" in k)
