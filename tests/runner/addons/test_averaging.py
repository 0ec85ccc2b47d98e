"""Weight averaging (runner/addons/averaging.py): EMA and SWA equal hand computations from the recorded raw
weights, are evaluated and logged beside them, and survive an interrupted run exactly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.engine import checkpoint
from runner.engine.engine import Engine
from tests.conftest import compose_spec
from tests.runner.engine.test_engine import ctrl_c_during_step, tracked

TINY = ["model.hidden=[16]", "dataset.batch_size=256", "trainer.progress_bar=off", "trainer.eval_every_epoch=false"]


def recording(engine: Engine) -> list[dict[str, torch.Tensor]]:
    """The module's weights before the first optimizer step and after every one (as the loop counts them)."""
    seen = [{k: v.detach().clone() for k, v in engine.module.state_dict().items()}]
    real = engine.train_step

    def step(micro_batches):
        out = real(micro_batches)
        seen.append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
        return out

    engine.train_step = step
    return seen


def assert_close_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("warmup, accum", [(False, 1), (True, 2)])
def test_ema_equals_the_hand_computed_average_of_the_weights_after_each_optimizer_step(tmp_path: Path, warmup: bool,
                                                                                       accum: int) -> None:
    decay = 0.9  # with warm-up, every step here is inside it: (1 + t) / (10 + t) < 0.9 up to t = 80
    engine = Engine(compose_spec([*TINY, "trainer.max_steps=6", f"trainer.ema.decay={decay}",
                                  f"trainer.ema.warmup={str(warmup).lower()}", f"+accum={accum}"], tmp_path / "run"))
    seen = recording(engine)
    engine.fit()
    assert len(seen) == 7  # one update per optimizer step, not per micro-batch
    ema = {k: v.clone() for k, v in seen[0].items()}
    for t, weights in enumerate(seen[1:], start=1):
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        ema = {k: d * ema[k] + (1 - d) * weights[k] for k in ema}
    saved = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")
    assert saved["addons"]["averages"]["ema"]["count"] == 6
    assert_close_weights(saved["addons"]["averages"]["ema"]["values"], ema)
    assert_close_weights(saved["model"], seen[-1])  # the raw weights are checkpointed as they are, beside the EMA
    assert not any(torch.allclose(ema[k], seen[-1][k]) for k in ema)  # the average is not the raw weights


def test_swa_is_the_mean_of_the_end_of_epoch_weights_and_swalr_anneals_to_its_lr(tmp_path: Path) -> None:
    engine = Engine(compose_spec([*TINY, "trainer.max_epochs=3", "trainer.swa.start_epoch=1", "trainer.swa.lr=0.002",
                                  "trainer.log_every_n_steps=1", "optimizer.lr=0.01"], tmp_path / "run"))
    seen = recording(engine)
    engine.fit()
    per_epoch = engine.steps_per_epoch
    ends = [seen[per_epoch * (epoch + 1)] for epoch in (1, 2)]  # the ends of epochs 1 and 2 (from 0)
    swa = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")["addons"]["averages"]["swa"]
    assert swa["count"] == 2
    assert_close_weights(swa["values"], {k: (ends[0][k] + ends[1][k]) / 2 for k in ends[0]})
    lrs = [lr for _, lr in engine.monitor.history["lr"]]
    assert lrs[per_epoch] == pytest.approx(0.01)  # the first SWA step still uses the run's own lr
    assert lrs[2 * per_epoch:] == pytest.approx([0.002] * per_epoch)  # annealed within anneal_epochs=1, then held


def test_averaged_metrics_are_declared_for_the_objective_early_stopping_and_plateau(tmp_path: Path) -> None:
    from runner.specs.metric_names import produced_metrics
    from tests.runner.cli.test_cli import preflight_ok

    args = ["trainer.ema.decay=0.99", "trainer.swa.start_epoch=2", "objective.metric=val/ema/acc",
            "trainer.early_stopping.monitor=val/swa/loss", "scheduler=plateau", "scheduler.monitor=val/ema/loss"]
    preflight_ok(args)
    produced = produced_metrics(compose_spec(args, tmp_path))
    assert {"val/ema/acc", "val/ema/loss", "val/swa/top5", "test/ema/acc", "test/swa/loss"} <= produced
    assert not any("/ema/" in m or "/swa/" in m for m in produced_metrics(compose_spec([], tmp_path)))


# --- MLflow and resume ---------------------------------------------------------------------------------

AVERAGED = [*TINY, "dataset.batch_size=512", "trainer.max_epochs=3", "trainer.eval_every_epoch=true",
            "trainer.checkpoint_every_n_steps=2",
            "trainer.ema.decay=0.8", "trainer.swa.start_epoch=1", "trainer.swa.lr=0.002", "objective.metric=val/ema/acc",
            "model.dropout=0.2"]


def logged_metrics(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """The run's evaluation metrics (raw and averaged weights) as MLflow holds them."""
    run = client.get_run(run_id)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in run.data.metrics if key.startswith(("val/", "test/"))}


def hand_val_loss(engine: Engine, weights: dict[str, torch.Tensor]) -> float:
    """Mean cross-entropy of `weights` over the validation split, computed here without the engine's evaluation."""
    module = engine.module
    raw = {k: v.clone() for k, v in module.state_dict().items()}
    module.load_state_dict(weights)
    module.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, labels in engine.eval_loaders["val"]:
            total += torch.nn.functional.cross_entropy(module(inputs), labels, reduction="sum").item()
            count += len(labels)
    module.load_state_dict(raw)
    return total / count


def test_averaged_weights_are_logged_evaluated_and_resumed_exactly(tmp_path: Path, sqlite_uri: str) -> None:
    """An interrupted run resumed in place logs to MLflow what the uninterrupted run evaluated (its monitor
    records every value it logs), the EMA's val/ema/loss is the EMA weights' loss, and both averages end equal."""
    from mlflow.tracking import MlflowClient

    full = Engine(compose_spec(AVERAGED, tmp_path / "full"))
    result = full.fit()
    # 3 steps an epoch: stopped in step 9, resumed from step 8, after epoch 1's end and its SWA update
    cut = ctrl_c_during_step(tracked(AVERAGED, tmp_path / "cut", sqlite_uri), 9)
    with pytest.raises(KeyboardInterrupt):
        cut.fit()
    resumed = tracked([*AVERAGED, f"trainer.resume={tmp_path / 'cut'}"], tmp_path / "cut", sqlite_uri)
    assert resumed.progress.step == 8 and resumed.averages.swa.count == 1
    resumed.fit()

    logged = logged_metrics(MlflowClient(sqlite_uri), cut.tracker.run_id)
    want = {k: v for k, v in full.monitor.history.items() if k.startswith(("val/", "test/"))}
    assert {"val/ema/loss", "val/ema/acc", "val/swa/acc", "test/ema/acc", "test/swa/loss"} <= set(logged)
    assert logged == want
    assert [s for s, _ in logged["val/swa/acc"]] == [s for s, _ in logged["val/acc"]][1:]  # from epoch 1's end on
    averages = {run: checkpoint.load(tmp_path / run / "checkpoints" / "last.pt")["addons"]["averages"] for run in ("full", "cut")}
    assert logged["val/ema/loss"][-1][1] == pytest.approx(hand_val_loss(full, averages["full"]["ema"]["values"]), rel=1e-6)
    assert logged["val/ema/loss"][-1][1] != pytest.approx(logged["val/loss"][-1][1], rel=1e-3)
    assert result.objective == max(v for _, v in logged["val/ema/acc"])  # objective.metric=val/ema/acc
    for kind in ("ema", "swa"):
        assert averages["cut"][kind]["count"] == averages["full"][kind]["count"]
        for key, value in averages["full"][kind]["values"].items():
            assert torch.equal(averages["cut"][kind]["values"][key], value), (kind, key)


# --- BatchNorm and several ranks -----------------------------------------------------------------------

def test_swa_batchnorm_statistics_are_recomputed_for_the_averaged_weights(tmp_path: Path) -> None:
    from torch.optim.swa_utils import update_bn

    engine = Engine(compose_spec(["model=cnn", "model.channels=[8]", "dataset.batch_size=512", "trainer.max_epochs=2",
                                  "trainer.swa.start_epoch=0", "trainer.progress_bar=off", "trainer.eval_every_epoch=false"],
                                 tmp_path / "run"))
    engine.fit()
    swa = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")["addons"]["averages"]["swa"]["values"]
    by_hand = {k: v.clone() for k, v in swa.items()}
    engine.module.load_state_dict(by_hand)
    engine.train_loader.batch_sampler.set_epoch(2)
    update_bn(engine.train_loader, engine.module)  # digits batches are (inputs, labels): update_bn takes inputs
    stats = [k for k in swa if k.endswith(("running_mean", "running_var"))]
    assert stats
    for key in stats:
        torch.testing.assert_close(swa[key], engine.module.state_dict()[key], rtol=1e-5, atol=1e-6, msg=key)
    raw = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")["model"]
    assert not any(torch.allclose(swa[key], raw[key]) for key in stats)  # not the raw weights' statistics


PARALLEL = ["dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.size=1000", "dataset.val_fraction=0.1",
            "dataset.test_fraction=0.1", "model=mlp", "model.hidden=[32,32]", "optimizer=adamw", "trainer.max_epochs=3",
            "trainer.progress_bar=off", "trainer.ema.decay=0.9", "trainer.ema.warmup=true", "trainer.swa.start_epoch=1",
            "trainer.swa.lr=0.0005"]


# slow (~45 s each with gloo on a shared CPU): in CI the single-process tests above keep the averages' values;
# what these add is that each rank averages its own full weights (ddp) or its own shards (fsdp) alike
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_average_like_one_process_with_the_global_batch(tmp_path: Path, strategy: str) -> None:
    from tests.conftest import run_cli
    from tests.runner.engine.test_parallel import assert_same

    Engine(compose_spec([*PARALLEL, "dataset.batch_size=32"], tmp_path / "single")).fit()
    ranks = [*PARALLEL, f"parallelism={strategy}", "parallelism.nproc_per_node=2", "dataset.batch_size=16", "tracking=none",
             "trainer.checkpoint_every_n_steps=30", "trainer.keep_checkpoints=10"]
    proc = run_cli([*ranks, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    want = checkpoint.load(tmp_path / "single" / "checkpoints" / "last.pt")
    got = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")
    for kind in ("ema", "swa"):
        assert got["addons"]["averages"][kind]["count"] == want["addons"]["averages"][kind]["count"]
        assert_same(got["addons"]["averages"][kind]["values"], want["addons"]["averages"][kind]["values"])
    assert {k: v for k, v in got["final"].items() if "/ema/" in k or "/swa/" in k} == pytest.approx(
        {k: v for k, v in want["final"].items() if "/ema/" in k or "/swa/" in k}, rel=1e-5)
    # resumed from step 60 (epoch 2 of 25-step epochs: SWA and SWALR under way), the ranks end with the same averages
    step_60 = tmp_path / "run" / "checkpoints" / "step-00000060.pt"
    proc = run_cli([*ranks, f"trainer.resume={step_60}", f"hydra.run.dir={tmp_path / 'resumed'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    resumed = checkpoint.load(tmp_path / "resumed" / "checkpoints" / "last.pt")["addons"]["averages"]
    for kind in ("ema", "swa"):
        assert all(torch.equal(value, resumed[kind]["values"][key]) for key, value in got["addons"]["averages"][kind]["values"].items())
