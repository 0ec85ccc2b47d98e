"""Sharded checkpoints (runner/engine/checkpoint.py, runner/engine/parallel/state.py): each rank writes only its
share, a checkpoint resumes at another mesh as if never stopped, a torn one is refused and the previous one used,
the one-file layout of older runs still loads, and export reads a sharded checkpoint (real gloo ranks)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from runner.engine import checkpoint, run_weights
from runner.results.export import export_checkpoint
from runner.engine import components
from runner.engine.run_data import build_data
from runner.specs.run import RunSpec, SpecError
from tests.runner.engine.test_pipeline_parallel import assert_same, run_one, run_two, weights
from tests.runner.engine.test_resume import migrated, mlflow_record

GPT = ["dataset=synthetic_tokens", "dataset.vocab_size=64", "dataset.block_size=16", "dataset.size=90",
       "model=gpt", "model.n_embd=32", "model.n_head=2", "task=language_modeling", "optimizer=sgd",
       "trainer.max_epochs=1", "trainer.progress_bar=off", "trainer.eval_every_n_steps=3", "trainer.log_every_n_steps=1",
       "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3", "trainer.keep_checkpoints=5", "trainer.ema.decay=0.9"]
FSDP2 = ["parallelism=fsdp", "parallelism.nproc_per_node=2", "dataset.batch_size=4"]
ONE = ["dataset.batch_size=8"]  # the global batch of FSDP2


def _losses(db: Path) -> list[tuple[int, float]]:
    [(status, history, _)] = mlflow_record(db).values()
    assert status == "FINISHED"
    return history["train/loss"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, migrated_mlflow_store: Path) -> Path:
    where = tmp_path_factory.mktemp("one")
    run_one([*GPT, *ONE], where / "run", migrated(where / "mlflow.db", migrated_mlflow_store))
    return where


def test_each_rank_writes_its_share_and_the_checkpoint_resumes_at_another_mesh_as_if_never_stopped(
        tmp_path: Path, one_process: Path, migrated_mlflow_store: Path, two_ranks) -> None:
    """fsdp on 2 ranks: each rank's shard file holds about half the state (each sharded tensor in two pieces, one
    per rank); its step-3 checkpoint resumed in one process, and one process's resumed under fsdp, end with the
    uninterrupted run's weights and log its train/loss (read back from MLflow)."""
    run_two([*GPT, *FSDP2], tmp_path / "two", two_ranks=two_ranks)
    folder = tmp_path / "two" / "checkpoints" / "step-00000003.pt"
    shards = [(folder / f"__{rank}_0.distcp").stat().st_size for rank in (0, 1)]
    assert all(0.4 < size / sum(shards) < 0.6 for size in shards), shards
    metadata = checkpoint.tensor_keys(folder)
    wte = metadata["model/wte.weight"]
    assert [tuple(c.sizes) for c in wte.chunks] == [(32, 32), (32, 32)]  # the 64 x 32 embedding: half on each rank
    assert len(metadata["optim/wte.weight/momentum_buffer"].chunks) == 2
    assert len(metadata["averages/ema/wte.weight"].chunks) == 2
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    assert set(manifest["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "record.pt"}

    want = weights(one_process / "run")
    assert_same(weights(tmp_path / "two"), want)
    run_one([*GPT, *ONE, f"trainer.resume={folder}"], tmp_path / "from_two",
            migrated(tmp_path / "from_two.db", migrated_mlflow_store))
    assert_same(weights(tmp_path / "from_two"), want)
    want_losses = dict(_losses(one_process / "mlflow.db"))
    got = _losses(tmp_path / "from_two.db")
    assert [s for s, _ in got] == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([want_losses[s] for s, _ in got]))

    run_two([*GPT, *FSDP2, f"trainer.resume={one_process / 'run' / 'checkpoints' / 'step-00000003.pt'}"],
            tmp_path / "from_one", two_ranks=two_ranks)
    assert_same(weights(tmp_path / "from_one"), want)
    ema = [checkpoint.load(d / "checkpoints" / "last.pt")["addons"]["averages"]["ema"] for d in
           (one_process / "run", tmp_path / "from_one")]
    assert ema[0]["count"] == ema[1]["count"] == 6
    assert_same(ema[1]["values"], ema[0]["values"])

    # export reads the fsdp checkpoint in one process, tensor by tensor, into one consolidated file
    from safetensors.torch import load_model

    out = export_checkpoint(tmp_path / "two", tmp_path / "export", program=False, which="last", average="none")
    saved = checkpoint.load(tmp_path / "two" / "checkpoints" / "last.pt")
    spec = RunSpec.from_yaml(saved["spec"])
    model = components.build_model(spec, build_data(spec))
    load_model(model, str(out / "model.safetensors"))  # safetensors' own reader: the tied lm head from its metadata
    assert all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items())


def test_a_torn_checkpoint_is_refused_in_one_line_and_the_previous_one_is_used(
        tmp_path: Path, one_process: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(one_process / "run", run, symlinks=True)
    newest, previous = (run / "checkpoints" / f"step-{s:08d}.pt" for s in (6, 3))
    assert checkpoint.resolve(run) == newest and (run / "checkpoints" / "last.pt").resolve() == newest.resolve()
    (newest / checkpoint.MANIFEST).unlink()  # killed before its manifest: torn
    with pytest.raises(SpecError, match=r"^trainer.resume: .*step-00000006.pt is not a valid runner checkpoint "
                                        r"\(it has no manifest: the save was interrupted, the folder is torn\)$"):
        checkpoint.read(newest)
    with caplog.at_level(logging.WARNING):
        path, record = checkpoint.read(run)
    assert path == previous and record["progress"]["step"] == 3 and "skipping checkpoint" in caplog.text
    shard = previous / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SpecError, match=r"checksum mismatch of __0_0.distcp"):
        checkpoint.read(previous)
    with pytest.raises(SpecError, match=r"^trainer.resume: no valid checkpoint in .*: all 2 refused"):
        checkpoint.read(run)


def test_a_one_file_checkpoint_of_an_older_run_still_resumes_and_evaluates(tmp_path: Path, one_process: Path) -> None:
    """A checkpoint in the one-file layout runs wrote before checkpoints were sharded (written here by that
    layout's own writer, checkpoint.save, from the same state) resumes bitwise like the sharded one."""
    state = checkpoint.load(one_process / "run" / "checkpoints" / "step-00000003.pt")
    state.pop("optimizer_groups")
    old = checkpoint.save(tmp_path / "old" / "checkpoints", 3, state, keep=2)
    assert old.is_file() and checkpoint.is_checkpoint(old.read_bytes()[:64])
    run_one([*GPT, *ONE, f"trainer.resume={old}"], tmp_path / "from_old")
    want = weights(one_process / "run")
    got = weights(tmp_path / "from_old")
    assert all(torch.equal(got[k], want[k]) for k in want)
    # a reader's one function: the weights of either layout into a plain module in this process
    spec = RunSpec.from_yaml(state["spec"])
    for source in (old, one_process / "run" / "checkpoints" / "step-00000003.pt"):
        module = components.build_model(spec, build_data(spec))
        run_weights.read(source).load_into(module)
        assert all(torch.equal(v, state["model"][k]) for k, v in module.state_dict().items())
