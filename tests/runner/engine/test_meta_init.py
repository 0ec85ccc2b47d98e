"""The model built on the meta device where the run shards it (runner/engine/parallel/parallelize.py, seed.py):
initial weights bitwise one process's under fsdp, tp, pp and fsdp x tp; training as one process's; no rank
allocating a whole-size copy of a sharded parameter; the fallback for a model that cannot be built on meta; the
seed folder gone after the start, and none written by a resumed run."""
from __future__ import annotations

import os
from pathlib import Path

from typing import Optional

import pytest
import torch
import torch.multiprocessing as mp

from models.gpt import GPT as GptModel
from runner.engine.engine import Engine
from runner.engine.parallel import DistEnv, full_model_state
from tests.conftest import compose_spec
from tests.runner.engine.test_parallel import free_port
from tests.runner.engine.test_tensor_parallel import assert_same_metrics, train
from tests.runner.engine.test_parallel import assert_same, final_weights

# vocabulary 512: the token embedding (and the tied lm head, 512 x 128) is the largest parameter, larger than the
# fused qkv (384 x 128) that tp reads whole (seed.py); 4 heads divide by tp=2
GPT = ["task=language_modeling", "model=gpt", "model.size=tiny", "model.n_head=4", "dataset=synthetic_tokens",
       "dataset.vocab_size=512", "dataset.block_size=12", "dataset.size=40", "dataset.val_fraction=0.1",
       "dataset.test_fraction=0.0", "dataset.batch_size=4", "model.bias=false", "optimizer=adamw",
       "trainer.max_steps=3", "trainer.progress_bar=off", "trainer.log_every_n_steps=1", "trainer.memory_estimate=false"]
ONE = ["dataset.batch_size=8"]  # the global batch of the fsdp runs (2 replicas of 4); tp and pp ranks are one replica
FSDP2 = ["parallelism=fsdp", "parallelism.nproc_per_node=2", "dataset.batch_size=4"]
TP2 = ["parallelism=single", "parallelism.tp=2", "dataset.batch_size=8"]
PP2 = ["parallelism=single", "parallelism.pp=2", "dataset.batch_size=8"]


def _initial(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    """This rank's engine built: the whole model's initial state gathered (a collective), the largest storage any
    op allocated off the meta device during the build, the torch RNG state after it, and the run directory's entries."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        """The storages ops made off the meta device: the largest, and the sum of the distinct ones. DCP's reads of
        the seed are left out: it loads one saved tensor at a time from its bytes (torch.load: a storage set into a
        tensor) and narrows it to the rank's shard, so one whole tensor exists for the moment of its read."""

        largest, total, seen = 0, 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and not t.is_meta}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and not t.is_meta and type(t) is torch.Tensor:
                    storage = t.untyped_storage()
                    if func is torch.ops.aten.set_.source_Storage_storage_offset:
                        Allocations.seen.add(storage.data_ptr())  # DCP's read, and the views narrowing it
                    elif storage.data_ptr() not in inputs and storage.data_ptr() not in Allocations.seen:
                        Allocations.seen.add(storage.data_ptr())
                        Allocations.largest = max(Allocations.largest, storage.nbytes())
                        Allocations.total += storage.nbytes()
            return out

    spec = compose_spec(overrides, Path(run_dir))
    with Allocations():
        engine = Engine(spec, env=DistEnv(rank, world, rank))
    state = {k: v.clone() for k, v in full_model_state(engine.module).items()}
    return {"state": state if rank == 0 else None, "largest": Allocations.largest, "total": Allocations.total, "rng": torch.get_rng_state(),
            "entries": sorted(p.name for p in Path(run_dir).iterdir()) if Path(run_dir).exists() else []}


def _worker(rank: int, world: int, port: int, overrides: list[str], run_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    report = _initial(rank, world, overrides, run_dir)
    torch.save(report, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


def initial(overrides: list[str], run_dir: Path, world: int, two_ranks=None) -> list[dict]:
    if world == 2 and two_ranks is not None:
        return two_ranks.run(_initial, overrides, str(run_dir))
    out = str(run_dir.parent / f"{run_dir.name}.report")
    mp.start_processes(_worker, args=(world, free_port(), overrides, str(run_dir), out), nprocs=world, start_method="spawn")
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process's initial state and the RNG state after its build."""
    torch.manual_seed(1234)  # no state of this process's own may reach the engine's
    spec = compose_spec([*GPT, *ONE], tmp_path_factory.mktemp("one") / "run")
    engine = Engine(spec)
    return {"state": {k: v.clone() for k, v in engine.module.state_dict().items()}, "rng": torch.get_rng_state(),
            "largest_parameter": max(p.numel() * p.element_size() for p in engine.module.parameters()),
            "model_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters())}


def assert_bitwise(state: dict, one: dict) -> None:
    assert state.keys() == one.keys()
    for key in one:
        assert torch.equal(state[key], one[key]), key


@pytest.mark.parametrize("degrees", [FSDP2, TP2, PP2], ids=["fsdp2", "tp2", "pp2"])
def test_the_initial_weights_and_rng_equal_one_processs_bitwise_and_no_rank_allocates_a_whole_sharded_parameter(
        tmp_path: Path, one_process: dict, degrees: list[str], two_ranks) -> None:
    reports = initial([*GPT, *degrees], tmp_path / "run", 2, two_ranks)
    assert_bitwise(reports[0]["state"], one_process["state"])
    for report in reports:
        assert torch.equal(report["rng"], one_process["rng"])  # the data order and dropout draw from it
        if degrees is PP2:  # each rank holds whole parameters of its stages only: less than the model in all
            assert report["total"] < 0.7 * one_process["model_bytes"], (report["total"], one_process["model_bytes"])
        else:  # every parameter is split: an allocation as large as the largest one would be a whole copy
            assert report["largest"] < one_process["largest_parameter"], report["largest"]
        assert not [e for e in report["entries"] if e.startswith(".seed")]  # the seed folder is gone


def test_meta_init_false_allocates_whole_parameters_as_before(tmp_path: Path, one_process: dict, two_ranks) -> None:
    """The allocation check above sees a whole model where one is built (it would fail without meta_init)."""
    reports = initial([*GPT, *FSDP2, "parallelism.meta_init=false"], tmp_path / "run", 2, two_ranks)
    assert_bitwise(reports[0]["state"], one_process["state"])
    assert all(r["largest"] >= one_process["largest_parameter"] for r in reports)
    assert all(r["total"] >= one_process["model_bytes"] for r in reports)


def test_fsdp_times_tp_initial_weights_equal_one_processs_bitwise(tmp_path: Path, one_process: dict) -> None:
    """4 processes: the fused qkv's strided tensor-parallel split under FSDP's shards (read whole, then placed)."""
    reports = initial([*GPT, "parallelism=fsdp", "parallelism.nproc_per_node=4", "parallelism.tp=2",
                       "dataset.batch_size=4"], tmp_path / "run", 4)
    assert_bitwise(reports[0]["state"], one_process["state"])
    for report in reports:
        assert torch.equal(report["rng"], one_process["rng"])
        assert report["largest"] < one_process["largest_parameter"], report["largest"]


TRAIN = ["trainer.max_steps=4", "trainer.eval_every_n_steps=2"]


@pytest.mark.parametrize("degrees", [FSDP2, PP2], ids=["fsdp2", "pp2"])
def test_a_run_built_on_meta_trains_like_one_process(tmp_path: Path, degrees: list[str], two_ranks) -> None:
    """The logged train/val losses (MLflow) as one process's; the weights bitwise those of the same run with every
    rank building the whole model (parallelism.meta_init=false), which differ from one process's only by the order
    of fp32 sums, scaled up by Adam on the smallest entries (see test_tensor_parallel.py)."""
    one = train([*GPT, *ONE, *TRAIN], tmp_path / "one")
    meta = train([*GPT, *TRAIN, *degrees], tmp_path / "meta", world=2, two_ranks=two_ranks)
    whole = train([*GPT, *TRAIN, *degrees, "parallelism.meta_init=false"], tmp_path / "whole", world=2, two_ranks=two_ranks)
    assert_bitwise(meta[0], whole[0])
    assert_same_metrics(one[1], meta[1])
    assert_same(meta[0], one[0], rtol=1e-3)


class RefusesMeta(GptModel):
    """A user's gpt whose constructor reads a value it makes: it cannot run on the meta device."""

    def __init__(self, vocab_size: int, max_length: int = 256, size: str = "tiny", n_layer: Optional[int] = None,
                 n_head: Optional[int] = None, n_embd: Optional[int] = None, dropout: float = 0.0, bias: bool = True):
        if torch.ones(1).is_meta:
            raise NotImplementedError("reads a value: bool() of a meta tensor")
        super().__init__(vocab_size, max_length, size, n_layer, n_head, n_embd, dropout, bias)


USER = ["model._target_=tests.runner.engine.test_meta_init.RefusesMeta"]


def _said(rank: int, world: int, overrides: list[str], run_dir: str) -> dict:
    """_initial's report with the lines parallelize.py logged on this rank, or the SpecError's line."""
    import logging

    from runner.specs.run import SpecError

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("runner.engine.parallel.parallelize")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return {**_initial(rank, world, overrides, run_dir), "said": lines}
    except SpecError as e:
        return {"refused": str(e)}
    finally:
        logger.removeHandler(handler)


def test_a_model_that_cannot_be_built_on_meta_is_said_in_one_line_and_built_whole_as_before(tmp_path: Path,
                                                                                             two_ranks) -> None:
    one = _initial(0, 1, [*GPT, *ONE, *USER], str(tmp_path / "one"))
    reports = two_ranks.run(_said, [*GPT, *FSDP2, *USER], str(tmp_path / "fsdp"))
    assert_bitwise(reports[0]["state"], one["state"])
    assert [line for line in reports[0]["said"] if "meta" in line] == [
        "parallelism.meta_init: tests.runner.engine.test_meta_init.RefusesMeta cannot be built on the meta device "
        "(NotImplementedError: reads a value: bool() of a meta tensor): every rank builds the whole model"]
    assert reports[1]["said"] == []  # rank 0 says it
    refused = two_ranks.run(_said, [*GPT, *FSDP2, *USER, "parallelism.meta_init=true"], str(tmp_path / "true"))
    assert refused[0]["refused"].startswith("parallelism.meta_init: true, but tests.runner.engine.test_meta_init."
                                            "RefusesMeta cannot be built on the meta device")


def _seeds_written(rank: int, world: int, overrides: list[str], run_dir: str) -> int:
    """How many seed checkpoints this rank's engine asked for while it was built (seed.write counted, not replaced)."""
    from runner.engine.parallel import seed

    calls, write = [], seed.write
    seed.write = lambda *args: calls.append(1) or write(*args)
    try:
        Engine(compose_spec(overrides, Path(run_dir)), env=DistEnv(rank, world, rank)).fit()
    finally:
        seed.write = write
    return len(calls)


def test_a_resumed_run_writes_no_seed_and_ends_as_if_never_stopped(tmp_path: Path, two_ranks) -> None:
    run = [*GPT, *FSDP2, "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=3"]
    assert two_ranks.run(_seeds_written, run, str(tmp_path / "whole")) == [1, 1]
    start = tmp_path / "whole" / "checkpoints" / "step-00000002.pt"
    assert two_ranks.run(_seeds_written, [*run, f"trainer.resume={start}"], str(tmp_path / "resumed")) == [0, 0]
    assert not list((tmp_path / "resumed").glob(".seed*"))
    assert_same(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "whole"), rtol=0)


def test_a_seed_build_that_refuses_its_input_is_refused_in_one_line_on_every_rank(tmp_path: Path, two_ranks) -> None:
    """The seed process's SpecError (here model.weights naming no file) reaches every rank; its folder is removed."""
    missing = tmp_path / "no-such-weights.pt"
    reports = two_ranks.run(_said, [*GPT, *FSDP2, f"model.weights={missing}"], str(tmp_path / "run"))
    assert reports[0]["refused"] == reports[1]["refused"]
    assert reports[0]["refused"].startswith("model.weights:") and "\n" not in reports[0]["refused"]
    assert not (tmp_path / "run").exists()
