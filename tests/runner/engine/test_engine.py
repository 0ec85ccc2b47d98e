"""The engine's correctness rules, proven with real runs on the digits data (CPU, fp32)."""
from pathlib import Path

import pytest
import torch

from runner.engine import checkpoint
from runner.engine.engine import Engine
from runner.tracking.tracker import best_key
from tests.conftest import compose_spec

FAST = ["trainer.eval_every_epoch=false", "trainer.progress_bar=off"]


def train(overrides: list[str], run_dir: Path, **kw) -> Engine:
    engine = Engine(compose_spec([*FAST, *overrides], run_dir, **kw))
    engine.fit()
    return engine


def tracked(overrides: list[str], run_dir: Path, uri: str) -> Engine:
    """An engine that logs to the MLflow store at uri, as the CLI builds it."""
    from runner.cli.launch import build_engine
    from runner.tracking.tracker import build_tracker

    spec = compose_spec(overrides, run_dir, tracking_uri=uri)
    return build_engine(spec, build_tracker(spec))


def ctrl_c_during_step(engine: Engine, step: int) -> Engine:
    """The engine with Ctrl-C arriving during its optimizer step `step` (counted as the run counts them)."""
    real_step = engine.train_step

    def interrupted(batches):
        if engine.progress.step == step - 1:
            raise KeyboardInterrupt
        return real_step(batches)

    engine.train_step = interrupted
    return engine


def assert_same_weights(a: Engine, b: Engine, rtol: float) -> None:
    sa, sb = a.module.state_dict(), b.module.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=rtol, atol=rtol * sa[key].abs().max().item(), msg=key)


# slow: test_accumulation_equals_the_big_batch[32-8-4-sgd] and [30-15-2-adamw] keep both optimizers, both
# accumulation counts and a ragged last batch in CI (each case is two 2-epoch runs; CI budget)
SLOW = pytest.mark.slow
ACCUMULATION = [pytest.param("sgd", 32, 8, 4, id="32-8-4-sgd"), pytest.param("adamw", 30, 15, 2, id="30-15-2-adamw"),
                pytest.param("adamw", 32, 8, 4, id="32-8-4-adamw", marks=SLOW),
                pytest.param("sgd", 40, 10, 4, id="40-10-4-sgd", marks=SLOW),
                pytest.param("adamw", 40, 10, 4, id="40-10-4-adamw", marks=SLOW),
                pytest.param("sgd", 30, 15, 2, id="30-15-2-sgd", marks=SLOW)]


@pytest.mark.parametrize("optimizer, big, small, accum", ACCUMULATION)
def test_accumulation_equals_the_big_batch(tmp_path: Path, optimizer: str, big: int, small: int, accum: int) -> None:
    """Batch B*N vs batch B with N micro-steps: same weights, also when the epoch's last batch is ragged."""
    common = [f"optimizer={optimizer}", "trainer.max_epochs=2", "model.hidden=[32]"]
    a = train([*common, f"dataset.batch_size={big}"], tmp_path / "a")
    b = train([*common, f"dataset.batch_size={small}", f"+accum={accum}"], tmp_path / "b")
    assert len(a.train_loader.dataset) % big != 0  # the last batch really is ragged
    assert a.progress.step == b.progress.step
    assert_same_weights(a, b, rtol=1e-5)


def test_a_step_of_unequal_micro_batches_follows_the_mean_over_all_its_samples(tmp_path: Path) -> None:
    """Normalised by the step's sample count, not by the number of micro-batches: micro-batches of 10, 10
    and 3 samples give the gradient of the mean loss over all 23 (the mean of the three means would not)."""
    import torch.nn.functional as F

    engine = Engine(compose_spec(["optimizer=sgd", "optimizer.momentum=0", "optimizer.lr=1", "optimizer.weight_decay=0", "+accum=3", *FAST,
                                  "model.hidden=[16]"], tmp_path / "run"))
    x, y = next(iter(engine.eval_loaders["val"]))
    parts = [(x[:10], y[:10]), (x[10:20], y[10:20]), (x[20:23], y[20:23])]
    before = [p.detach().clone() for p in engine.module.parameters()]
    exact = torch.autograd.grad(F.cross_entropy(engine.module(x[:23]), y[:23]), list(engine.module.parameters()))
    naive = torch.autograd.grad(sum(F.cross_entropy(engine.module(a), b) for a, b in parts) / 3,
                                list(engine.module.parameters()))
    engine.train_step(parts)
    steps = [b - p.detach() for b, p in zip(before, engine.module.parameters())]  # sgd, lr 1: the gradient
    for step, want, wrong in zip(steps, exact, naive):
        torch.testing.assert_close(step, want, rtol=1e-5, atol=1e-7)
    assert max((s - w).abs().max().item() for s, w in zip(steps, naive)) > 1e-3  # the check can tell them apart


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

    from runner.tracking.tracker import build_tracker

    full = train(RESUMABLE, tmp_path / "full")
    spec = compose_spec([*FAST, *RESUMABLE], tmp_path / "cut", tracking_uri=sqlite_uri)
    engine = ctrl_c_during_step(Engine(spec, build_tracker(spec)), 25)
    with pytest.raises(KeyboardInterrupt):
        engine.fit()
    client = MlflowClient(sqlite_uri)
    run = client.get_run(engine.tracker.run_id)
    assert run.info.status == "KILLED"

    # continuing in place, as `trainer.resume=<run dir>` plans it (runner/specs/resume.py)
    spec = compose_spec([*FAST, *RESUMABLE, f"trainer.resume={tmp_path / 'cut'}"], tmp_path / "cut",
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
    # every 3 steps, and at the end because step 7 had not been evaluated
    assert [s for s, _ in engine.monitor.history["val/acc"]] == [3, 6, 7]
    accs = [v for _, v in engine.monitor.history["val/acc"]]
    assert result.objective == max(accs)


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


def test_a_run_shorter_than_an_epoch_is_evaluated_at_its_end(tmp_path: Path, sqlite_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    engine = tracked(["trainer.max_steps=5", "trainer.progress_bar=off"], tmp_path / "run", sqlite_uri)
    result = engine.fit()
    assert result.objective == result.objective and 0 < result.objective <= 1  # not NaN
    history = MlflowClient(sqlite_uri).get_metric_history(engine.tracker.run_id, "val/acc")
    assert [(m.step, m.value) for m in history] == [(5, result.objective)]
    metrics = MlflowClient(sqlite_uri).get_run(engine.tracker.run_id).data.metrics
    assert metrics["objective"] == result.objective and metrics[best_key("val/acc")] == metrics["best_val_acc"] == result.objective


def test_an_empty_split_logs_nothing(tmp_path: Path, sqlite_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    engine = tracked(["trainer.max_epochs=2", "dataset.val_fraction=0", "objective.metric=test/acc",
                      "trainer.progress_bar=off"], tmp_path / "run", sqlite_uri)
    result = engine.fit()
    metrics = MlflowClient(sqlite_uri).get_run(engine.tracker.run_id).data.metrics
    assert not [k for k in metrics if k.startswith(("val/", "best_val_"))]
    assert metrics["test/acc"] == result.final["test/acc"] == result.objective > 0.5


@pytest.mark.parametrize("extra", [[], ["precision=bf16"], ["trainer.clip_grad_norm=1.0"], ["precision=fp16"],
                                   ["trainer.early_stopping.monitor=val/loss"]])
def test_a_diverging_run_stops_failed_and_never_checkpoints_broken_weights(tmp_path: Path, sqlite_uri: str,
                                                                         extra: list[str]) -> None:
    from mlflow.tracking import MlflowClient

    from runner.engine.monitor import Diverged

    engine = tracked(["optimizer=sgd", "optimizer.lr=1e6", "trainer.max_epochs=3", "trainer.checkpoint_every_n_steps=5",
                      "trainer.progress_bar=off", *extra], tmp_path / "run", sqlite_uri)
    with pytest.raises(Diverged, match=r"not finite from step \d+ on.*lower optimizer.lr \(now 1e\+06\)"):
        engine.fit()
    assert MlflowClient(sqlite_uri).get_run(engine.tracker.run_id).info.status == "FAILED"
    for ckpt in (tmp_path / "run" / "checkpoints").glob("*.pt"):
        state = checkpoint.load(ckpt)
        assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert engine.progress.step <= 10  # stopped at the first log step that saw it, not after 3 epochs


def test_fp16_stops_only_after_the_configured_run_of_non_finite_steps(tmp_path: Path) -> None:
    from runner.addons.non_finite_watch import NonFiniteWatch
    from runner.engine.monitor import Diverged

    spec = compose_spec(["precision=fp16", "trainer.max_non_finite_steps=3"], tmp_path / "run")
    watch = NonFiniteWatch(spec, torch.device("cpu"))
    nan, ok = torch.tensor(float("nan")), torch.tensor(1.0)
    for step, loss in enumerate([ok, nan, nan, ok, nan, nan], start=1):  # runs of 2: the scaler recovers
        watch.on_step(step, loss)
    watch.check(lambda values: values)
    watch.on_step(7, nan)
    with pytest.raises(Diverged, match="from step 5 on"):
        watch.check(lambda values: values)


@pytest.mark.parametrize("precision, hint", [("fp32", False), ("bf16", False), ("fp16", True)])
def test_the_divergence_hint_suggests_bf16_only_to_an_fp16_run(tmp_path: Path, precision: str, hint: bool) -> None:
    from runner.addons.non_finite_watch import NonFiniteWatch
    from runner.engine.monitor import Diverged

    spec = compose_spec([f"precision={precision}", "trainer.max_non_finite_steps=1"], tmp_path / "run")
    watch = NonFiniteWatch(spec, torch.device("cpu"))
    watch.on_step(1, torch.tensor(float("nan")))
    with pytest.raises(Diverged) as error:
        watch.check(lambda values: values)
    assert ("precision=bf16 instead of fp16" in str(error.value)) == hint
    assert str(error.value).startswith("the loss is not finite from step 1 on (1 step(s) in a row)")


def test_channels_last_keeps_conv_weights_channels_last_and_trains_to_the_same_weights(tmp_path: Path) -> None:
    """trainer.channels_last changes the memory layout only: the same weights as the default layout."""
    common = ["dataset=synthetic", "dataset.size=96", "dataset.shape=[3,8,8]", "model=cnn", "dataset.batch_size=16",
              "trainer.max_steps=3", "tracking=none"]
    plain = train(common, tmp_path / "plain")
    last = train([*common, "trainer.channels_last=true"], tmp_path / "last")
    convs = [p for p in last.module.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous() for p in convs)
    assert_same_weights(plain, last, rtol=1e-4)


def test_the_engines_backward_gives_the_gradients_of_loss_backward_with_the_scale() -> None:
    """Precision.backward hands its scalar gradient to autograd's engine call directly (runner/engine/
    precision.py): the gradients are bit for bit those of the public loss.backward(scale)."""
    from runner.engine import precision
    from runner.engine.precision import Precision
    from runner.specs.precision import PrecisionSpec

    assert precision._run_backward is not None  # this torch has the call: the direct path is the one tested
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    inputs, labels = torch.randn(10, 8), torch.randint(0, 3, (10,))
    grads = []
    for public in (True, False):
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels, reduction="sum")
        if public:
            loss.backward(torch.tensor(1 / 7))
        else:
            Precision(PrecisionSpec(name="fp32"), torch.device("cpu")).backward(loss, 1 / 7)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
