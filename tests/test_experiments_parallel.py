"""The experiment presets under ddp and fsdp (two gloo ranks on CPU) with accumulation, and resumed under ddp.

Each preset runs as its CI-sized variant (tests/test_experiments.py) in fp32 with dropout off, so that two
ranks can be compared with one process number for number:
- gpt_small and imdb_distilbert: one process with the global batch, ddp with half of it per rank, and fsdp
  with a quarter per rank and +accum=2 all end with the same weights and log the same train/loss, val and
  test metrics (MLflow, read back from each run's store).
- cifar10_resnet has BatchNorm, whose statistics are per micro-batch, so one process cannot match two ranks;
  ddp and fsdp with the same per-rank micro-batches and +accum=2 must still agree with each other (same
  parameters, same train/loss), augmentation included.
- every preset resumed from a mid-run checkpoint (gpt_small and imdb_distilbert under fsdp, the ResNet under
  ddp) ends bitwise equal to the uninterrupted run and logs the same numbers after the resume point.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import compose_spec, run_cli
from tests.data.test_text import write_imdb
from tests.data.test_torchvision_datasets import _write_cifar
from tests.runner.engine.test_parallel import final_weights, metric_history

COMMON = ["precision=fp32", "trainer.progress_bar=off", "trainer.log_every_n_steps=2", "trainer.checkpoint_every_n_steps=4",
          "trainer.keep_checkpoints=10"]

# Each preset's CI-sized variant; `batch` is the global batch. `adam_lr`: AdamW divides each gradient by its
# own running scale, so an element whose gradient is near zero turns float noise (summation order differs
# between ranks and micro-batches) into a step of up to lr: weights then agree to 1% of one step, far below
# what a lost or repeated micro-batch moves them (its whole step).
PRESETS = {
    "gpt_small": dict(batch=16, adam_lr=3e-3, args=[
        "dataset.max_chars=60000", "dataset.block_size=32", "dataset.vocab_size=300", "model.n_embd=32",
        "model.n_head=2", "model.n_layer=2",
        # no biases: the attention key bias has a gradient that is zero in exact arithmetic (softmax does not
        # see a shift shared by all keys), which AdamW turns from float noise into full-size steps
        "model.bias=false", "trainer.max_steps=8", "trainer.eval_every_n_steps=4"]),
    "imdb_distilbert": dict(batch=8, adam_lr=5e-5, args=[
        "dataset.max_length=48", "dataset.vocab_size=300", "model.config.dim=32", "model.config.n_layers=2",
        "model.config.n_heads=2", "model.config.hidden_dim=64", "model.config.dropout=0",
        "model.config.attention_dropout=0", "model.config.seq_classif_dropout=0", "trainer.max_epochs=2"]),
    "cifar10_resnet": dict(batch=16, adam_lr=0.0, args=["dataset.num_workers=2", "trainer.max_epochs=2"]),
}
# DistilBERT's key projection has a bias (see gpt_small's note): AdamW moves it by up to lr per step
# on float noise, without any effect on the outputs
OUTPUT_INVARIANT = ("k_lin.bias",)


def write_data(preset: str, root: Path) -> None:
    if preset == "imdb_distilbert":
        write_imdb(root, n_train=24, n_test=8)
    elif preset == "cifar10_resnet":
        _write_cifar(root, per_batch=24)
    # gpt_small: the offline corpus (the standard library), tokenized once into root/.cache


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    roots = {}
    for preset in PRESETS:
        roots[preset] = tmp_path_factory.mktemp(preset)
        write_data(preset, roots[preset])
    return roots


STORE_TEMPLATE: Path | None = None  # set for each test by migrated_stores


@pytest.fixture(autouse=True)
def migrated_stores(migrated_mlflow_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run's store (<where>/<name>.db) starts as a copy of one MLflow has migrated (tests/conftest.py):
    no first open of a store is tested here, and each migration costs seconds."""
    monkeypatch.setattr(f"{__name__}.STORE_TEMPLATE", migrated_mlflow_store)


def run(preset: str, root: Path, where: Path, name: str, *extra: str, in_process: bool = False) -> Path:
    shutil.copy(STORE_TEMPLATE, where / f"{name}.db")
    args = [f"experiment={preset}", f"dataset.root={root}", *PRESETS[preset]["args"], *COMMON, *extra]
    if in_process:  # as the CLI's launch runs it, without an interpreter start (seconds)
        from runner.cli import launch

        launch.run(compose_spec(args, where / name, f"sqlite:///{where / name}.db"))  # same store and artifact root
        return where / name
    args += [f"hydra.run.dir={where / name}", f"tracking.uri=sqlite:///{where / name}.db",
             f"tracking.artifact_root={where / 'artifacts'}"]
    proc = run_cli(args, where, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / name


def parallel(strategy: str, per_rank: int, accum: int) -> list[str]:
    return [f"parallelism={strategy}", "parallelism.nproc_per_node=2", f"dataset.batch_size={per_rank}",
            f"+accum={accum}"]


def history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    return metric_history(Path(f"{run_dir}.db"))


def assert_same_weights(a: dict, b: dict, parameters_only: bool = False, rtol: float = 1e-5, adam_lr: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if parameters_only and ("running_" in key or "num_batches_tracked" in key):
            continue
        if key.endswith(OUTPUT_INVARIANT):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-3, msg=key)
            continue
        atol = max(rtol * a[key].abs().max().item(), 0.01 * adam_lr)
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=key)


def assert_same_history(a: dict, b: dict, keys: list[str], after: int = 0) -> None:
    for key in keys:
        got = [(s, v) for s, v in b[key] if s > after]
        want = [(s, v) for s, v in a[key] if s > after]
        assert [s for s, _ in got] == [s for s, _ in want] and want, key
        for (_, x), (_, y) in zip(want, got):
            assert y == pytest.approx(x, rel=1e-5, abs=1e-7), key


def metric_keys(preset: str) -> list[str]:
    if preset == "gpt_small":
        return ["train/loss", "val/loss", "val/ppl", "test/loss", "lr", "objective"]
    return ["train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "lr", "objective"]


def resume_mid_run(preset: str, root: Path, where: Path, full: Path, *extra: str) -> None:
    """Resumed from the uninterrupted run's step-4 checkpoint: bitwise its weights, and its numbers after step 4."""
    resumed = run(preset, root, where, "resumed", *extra, f"trainer.resume={full / 'checkpoints' / 'step-00000004.pt'}")
    assert_same_weights(final_weights(full), final_weights(resumed), rtol=0)
    assert_same_history(history(full), history(resumed), [k for k in metric_keys(preset) if k != "objective"], after=4)


# CI: gpt_small under fsdp with +accum=2, and its resume; its ddp leg is slow (CI budget: three process starts;
# two ddp ranks equal one process in CI in tests/test_open_world.py's empty-share case, and the same rank
# reductions of a language model's token counts are the fsdp leg's)
@pytest.mark.parametrize("preset, strategies", [("gpt_small", ("fsdp",)),
                                                pytest.param("gpt_small", ("ddp",), marks=pytest.mark.slow),
                                                pytest.param("imdb_distilbert", ("ddp", "fsdp"), marks=pytest.mark.slow)],
                         ids=["gpt_small-fsdp", "gpt_small-ddp", "imdb_distilbert-ddp-fsdp"])
def test_a_preset_under_ddp_and_fsdp_with_accumulation_trains_like_one_process_and_resumes(
        tmp_path: Path, data_root, preset: str, strategies: tuple[str, ...]) -> None:
    batch, root = PRESETS[preset]["batch"], data_root[preset]
    one = run(preset, root, tmp_path, "one", f"dataset.batch_size={batch}", in_process=True)  # the launched runs' reference
    legs = {"ddp": parallel("ddp", batch // 2, 1), "fsdp": parallel("fsdp", batch // 4, 2)}
    for strategy in strategies:
        other = run(preset, root, tmp_path, strategy, *legs[strategy])
        assert_same_weights(final_weights(one), final_weights(other), adam_lr=PRESETS[preset]["adam_lr"])
        assert_same_history(history(one), history(other), metric_keys(preset))
    if "fsdp" in strategies:
        resume_mid_run(preset, root, tmp_path, tmp_path / "fsdp", *legs["fsdp"])


@pytest.mark.slow
def test_the_resnet_preset_with_batchnorm_trains_alike_under_ddp_and_fsdp_and_resumes(tmp_path: Path, data_root) -> None:
    """Same per-rank micro-batches, so the same BatchNorm statistics: equal parameters and train/loss.
    (Running statistics and evaluations are rank 0's under ddp and each rank's own under fsdp.) The resume
    reads augmented images in two loader workers per rank: the same crops and flips as the uninterrupted run."""
    root, batch = data_root["cifar10_resnet"], PRESETS["cifar10_resnet"]["batch"]
    ddp = run("cifar10_resnet", root, tmp_path, "ddp", *parallel("ddp", batch // 4, 2))
    fsdp = run("cifar10_resnet", root, tmp_path, "fsdp", *parallel("fsdp", batch // 4, 2))
    assert_same_weights(final_weights(ddp), final_weights(fsdp), parameters_only=True)
    assert_same_history(history(ddp), history(fsdp), ["train/loss", "lr"])
    resume_mid_run("cifar10_resnet", root, tmp_path, ddp, *parallel("ddp", batch // 4, 2))
