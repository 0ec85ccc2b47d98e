"""What the run reports, read back from MLflow: the learning rate each step used, and throughput
(samples/s, TFLOP/s, MFU) that counts training time only."""
import time
from pathlib import Path

import pytest

from tests.runner.engine.test_engine import tracked
from tests.runner.engine.test_flops import mlp_step_by_hand
from tests.runner.engine.test_parallel import metric_history

QUIET = ["trainer.progress_bar=off", "trainer.eval_every_epoch=false", "model.hidden=[16]"]


def test_the_logged_lr_is_the_one_each_step_used_for_every_group(tmp_path: Path, sqlite_uri: str) -> None:
    """A warmup to 1.0 over 4 steps; the first layer at 0.1 of the base rate, the second at 0.5."""
    engine = tracked(["optimizer=sgd", "optimizer.lr=1.0", "scheduler=warmup_cosine", "scheduler.warmup=4",
                      "optimizer.lr_multipliers={1.weight: 0.1, 1.bias: 0.1, 3.weight: 0.5}", "trainer.max_steps=8",
                      "trainer.log_every_n_steps=1", *QUIET], tmp_path / "run", sqlite_uri)
    used: list[dict[float, float]] = []  # each step's rate per multiplier, as the optimizer step saw it
    engine.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: used.append({g["lr_multiplier"]: g["lr"] for g in opt.param_groups}))
    engine.fit()
    history = metric_history(tmp_path / "mlflow.db")
    assert len(used) == 8 and used[0][1.0] < used[3][1.0]  # the warmup really climbs
    for name, multiplier in (("lr", 1.0), ("lr/x0.1", 0.1), ("lr/x0.5", 0.5)):
        assert history[name] == [(step, pytest.approx(rates[multiplier], rel=1e-12))
                                 for step, rates in enumerate(used, start=1)], name
    assert not [k for k in history if k.startswith("lr/") and k not in ("lr/x0.1", "lr/x0.5")]


def time_each_step(engine, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The list each optimizer step's seconds go into, on whatever clock the test moves."""
    real_step, seconds = engine.train_step, []

    def timed_step(batches):
        start = time.perf_counter()
        out = real_step(batches)
        seconds.append(time.perf_counter() - start)
        return out

    monkeypatch.setattr(engine, "train_step", timed_step)
    return seconds


def test_throughput_does_not_count_evaluation_and_checkpoint_time(tmp_path: Path, sqlite_uri: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each validation and checkpoint takes 100 s more on the clock: the logged samples/s must come from
    the training steps' own time (64 samples a step), not from the evaluations in the window."""
    offset = {"s": 0.0}
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset["s"])
    engine = tracked(["trainer.max_steps=12", "trainer.log_every_n_steps=4", "trainer.eval_every_n_steps=2",
                      "trainer.checkpoint_every_n_steps=3", "trainer.peak_tflops=0.5", *QUIET], tmp_path / "run", sqlite_uri)
    real_eval, real_save = engine.evaluate, engine.save_checkpoint
    step_seconds = time_each_step(engine, monkeypatch)

    def slow(real):
        def call(*args):
            offset["s"] += 100.0
            return real(*args)
        return call

    monkeypatch.setattr(engine, "evaluate", slow(real_eval))
    monkeypatch.setattr(engine, "save_checkpoint", slow(real_save))
    result = engine.fit()
    history = metric_history(tmp_path / "mlflow.db")
    logged = history["throughput/samples_per_s"]
    assert [s for s, _ in logged] == [4, 8, 12]
    for step, samples_per_s in logged:
        window = 4 * 64 / samples_per_s  # the seconds the window was timed at
        steps = sum(step_seconds[step - 4:step])
        assert steps <= window < steps + 50, (step, window, steps)  # each window held 2 validations of 100 s
    # TFLOP/s and MFU of the same windows: digits (8x8) through an MLP 64-16-10, FLOPs per sample by hand
    per_sample = mlp_step_by_hand(1, [64, 16, 10])
    assert [s for s, _ in history["throughput/tflops"]] == [s for s, _ in history["throughput/mfu"]] == [4, 8, 12]
    for (_, samples_per_s), (_, tflops), (_, mfu) in zip(logged, history["throughput/tflops"], history["throughput/mfu"]):
        assert tflops > 0 and tflops == pytest.approx(per_sample * samples_per_s / 1e12, rel=1e-9)
        assert mfu == pytest.approx(tflops / 0.5, rel=1e-9)
    assert result.tflops > 0 and result.mfu == pytest.approx(result.tflops / 0.5, rel=1e-9)
    assert "compile/seconds" not in history  # nothing compiled


def test_every_logged_training_value_is_that_of_a_plain_loop_doing_the_engines_arithmetic(
        tmp_path: Path, sqlite_uri: str) -> None:
    """The step loop's shortcuts (the loss scale handed to backward as the loss's gradient, the window read
    without tensors in one process, the lr read on log steps only, clipping over a cached parameter list)
    change no logged value: train/loss, grad_norm, lr and epoch of every step, read back from MLflow, equal
    bit for bit those of a plain loop computing the loss sum x 1/count, its backward, torch's clip_grad_norm_
    and the optimizer step. Batch 500: the epoch's last batch is ragged, so two scales are used."""
    import copy

    import torch
    import torch.nn.functional as F

    from runner.engine.optim import build_optimizer

    engine = tracked(["dataset.batch_size=500", "trainer.max_steps=4", "trainer.log_every_n_steps=1",
                      "trainer.clip_grad_norm=0.5", "trainer.memory_estimate=false", *QUIET], tmp_path / "run", sqlite_uri)
    model = copy.deepcopy(engine.module)
    optimizer = build_optimizer(engine.spec.optimizer, model, torch.device("cpu"))
    batches = []
    for epoch in range(2):
        engine.train_loader.batch_sampler.set_epoch(epoch)
        batches += list(engine.train_loader)
    assert len({len(labels) for _, labels in batches[:4]}) == 2  # a ragged batch among the four steps
    want: dict[str, list[tuple[int, float]]] = {"train/loss": [], "grad_norm": [], "lr": [], "epoch": []}
    for step, (inputs, labels) in enumerate(batches[:4], start=1):
        want["lr"].append((step, optimizer.param_groups[0]["lr"]))
        loss = F.cross_entropy(model(inputs).float(), labels, reduction="sum", ignore_index=-100)
        (loss * (1 / len(labels))).backward()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        want["train/loss"].append((step, loss.item() / len(labels)))
        want["grad_norm"].append((step, norm.item()))
        want["epoch"].append((step, step / engine.steps_per_epoch))
    engine.fit()
    history = metric_history(tmp_path / "mlflow.db")
    assert {key: history[key] for key in want} == want
    for got, ref in zip(engine.module.parameters(), model.parameters()):
        assert torch.equal(got, ref)
