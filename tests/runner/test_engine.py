"""The engine's correctness rules, proven with real runs on the digits data (CPU, fp32)."""
from pathlib import Path

import pytest
import torch

from runner.engine import Engine
from tests.conftest import compose_spec

FAST = ["trainer.eval_every_epoch=false", "trainer.progress_bar=off"]


def train(overrides: list[str], run_dir: Path, **kw) -> Engine:
    engine = Engine(compose_spec([*FAST, *overrides], run_dir, **kw))
    engine.fit()
    return engine


def assert_same_weights(a: Engine, b: Engine, rtol: float) -> None:
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=rtol, atol=rtol * sa[key].abs().max().item(), msg=key)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("big, small, accum", [(32, 8, 4), (40, 10, 4), (30, 15, 2)])
def test_accumulation_equals_the_big_batch(tmp_path: Path, optimizer: str, big: int, small: int, accum: int) -> None:
    """Batch B*N vs batch B with N micro-steps: same weights, also when the epoch's last batch is ragged."""
    common = [f"optimizer={optimizer}", "trainer.max_epochs=2", "model.hidden=[32]"]
    a = train([*common, f"dataset.batch_size={big}"], tmp_path / "a")
    b = train([*common, f"dataset.batch_size={small}", f"+accum={accum}"], tmp_path / "b")
    assert len(a.train_loader.dataset) % big != 0  # the last batch really is ragged
    assert a.progress.step == b.progress.step
    assert_same_weights(a, b, rtol=1e-5)


def test_accumulation_changes_nothing_but_the_grouping(tmp_path: Path) -> None:
    """Sanity: without the exact normalization the weights would differ; with a different batch they do."""
    a = train(["trainer.max_steps=5", "dataset.batch_size=16"], tmp_path / "a")
    b = train(["trainer.max_steps=5", "dataset.batch_size=8"], tmp_path / "b")
    with pytest.raises(AssertionError):
        assert_same_weights(a, b, rtol=1e-5)


RESUMABLE = ["optimizer=adamw", "scheduler=warmup_cosine", "scheduler.warmup=5", "model.dropout=0.2",
             "trainer.max_steps=45", "trainer.checkpoint_every_n_steps=10", "trainer.keep_checkpoints=10",
             "trainer.eval_every_n_steps=15", "+accum=2"]


def test_resume_from_a_mid_epoch_checkpoint_ends_with_the_same_weights(tmp_path: Path) -> None:
    full = train(RESUMABLE, tmp_path / "full")
    ckpt = tmp_path / "full" / "checkpoints" / "step-00000010.pt"
    assert ckpt.exists()
    resumed = train([*RESUMABLE, f"trainer.resume={ckpt}"], tmp_path / "resumed")
    assert resumed.progress.step == 45
    assert_same_weights(full, resumed, rtol=0)
    assert resumed.monitor.history["val/loss"] == full.monitor.history["val/loss"]


def test_interrupted_run_resumes_from_its_run_dir_into_the_same_mlflow_run(tmp_path: Path, sqlite_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    from runner.tracking import build_tracker

    full = train(RESUMABLE, tmp_path / "full")
    spec = compose_spec([*FAST, *RESUMABLE], tmp_path / "cut", tracking_uri=sqlite_uri)
    engine = Engine(spec, build_tracker(spec))
    real_step = engine.train_step
    calls = {"n": 0}

    def ctrl_c_at_step_25(batches):  # Ctrl-C arrives during the 25th optimizer step
        calls["n"] += 1
        if calls["n"] == 25:
            raise KeyboardInterrupt
        return real_step(batches)

    engine.train_step = ctrl_c_at_step_25
    with pytest.raises(KeyboardInterrupt):
        engine.fit()
    client = MlflowClient(sqlite_uri)
    run = client.get_run(engine.tracker.run_id)
    assert run.info.status == "KILLED"

    spec = compose_spec([*FAST, *RESUMABLE, f"trainer.resume={tmp_path / 'cut'}"], tmp_path / "resumed",
                        tracking_uri=sqlite_uri)
    resumed = Engine(spec, build_tracker(spec))
    assert resumed.progress.step == 20  # the newest checkpoint before the interruption
    resumed.fit()
    assert_same_weights(full, resumed, rtol=0)
    assert resumed.tracker.run_id == engine.tracker.run_id
    run = client.get_run(engine.tracker.run_id)
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert max(steps) == 45 and 10 in steps


def test_max_steps_wins_over_epochs_and_objective_is_the_best_evaluation(tmp_path: Path) -> None:
    engine = Engine(compose_spec(["trainer.max_steps=7", "trainer.max_epochs=1", "trainer.eval_every_n_steps=3",
                                  "trainer.progress_bar=off"], tmp_path / "run"))
    result = engine.fit()
    assert result.steps == 7
    accs = [v for _, v in engine.monitor.history["val/acc"]]
    assert len(accs) == 2 and result.objective == max(accs)


def test_early_stopping_stops_after_patience_evaluations(tmp_path: Path) -> None:
    engine = Engine(compose_spec(["trainer.max_epochs=50", "optimizer.lr=1e-9", "trainer.progress_bar=off",
                                  "trainer.early_stopping.monitor=val/acc", "trainer.early_stopping.mode=max",
                                  "trainer.early_stopping.patience=2", "trainer.early_stopping.min_delta=0.01"],
                                 tmp_path / "run"))
    engine.fit()
    assert len(engine.monitor.history["val/acc"]) == 3  # the first sets the reference, two more without improvement
    assert engine.progress.epoch == 3


def test_gradient_clipping_by_norm_bounds_the_update(tmp_path: Path) -> None:
    engine = Engine(compose_spec(["trainer.max_steps=1", "optimizer=sgd", "optimizer.momentum=0", "optimizer.lr=1", "optimizer.weight_decay=0",
                                  "trainer.clip_grad_norm=0.001", "trainer.progress_bar=off", "trainer.eval_every_epoch=false"],
                                 tmp_path / "run"))
    before = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
    engine.fit()
    after = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(0.001, rel=1e-3)
