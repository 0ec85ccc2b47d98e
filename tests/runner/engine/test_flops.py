"""FLOPs, TFLOP/s and MFU (runner/engine/flops.py): the count of a known model equals the hand count, the peak
table and its override, MFU's arithmetic. The metrics read back from MLflow: tests/runner/engine/test_monitor.py."""
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.engine import flops


def mlp_step_by_hand(batch: int, widths: list[int], trained: list[bool] | None = None) -> int:
    """One forward and backward of Linear layers in a chain, 2 FLOPs per multiply-add: forward 2·B·in·out
    per layer; backward the weight gradient (2·B·in·out) of every trained layer and the input gradient
    (2·B·in·out) of every layer above a trained one (below it, nothing needs it)."""
    trained = trained or [True] * (len(widths) - 1)
    total = 0
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        mm = 2 * batch * n_in * n_out
        total += mm + mm * trained[i] + mm * any(trained[:i])
    return total


def test_the_count_of_an_mlp_step_is_the_hand_count_and_6_n_per_sample_past_the_first_layer() -> None:
    widths = [64, 32, 16, 10]
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
    x = torch.zeros(5, 1, 8, 8)
    got = flops.micro_step_flops(model, x, None, batch_size=48, pass_labels=False)
    assert got == mlp_step_by_hand(48, widths)
    weights = 64 * 32 + 32 * 16 + 16 * 10
    assert got == 6 * weights * 48 - 2 * 64 * 32 * 48  # 6N per sample, less the first layer's input gradient
    model[1].requires_grad_(False)  # frozen: no weight gradient, and no input gradient below the next layer
    assert flops.micro_step_flops(model, x, None, 48, False) == mlp_step_by_hand(48, widths, [False, True, True])


def test_counting_touches_no_weight_statistic_gradient_or_random_stream() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, rng = torch.randn(4, 8), torch.get_rng_state()
    assert flops.micro_step_flops(model, x, None, 16, False) == 2 * 16 * (64 + 24) * 3 - 2 * 16 * 64
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm's running stats too
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 80GB HBM3", "fp8", 1978.9),
    ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H100 NVL", "fp16", 835.2), ("NVIDIA H200", "bf16_true", 989.4),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0), ("NVIDIA A100 80GB PCIe", "fp32", 19.5), ("NVIDIA A100-SXM4-40GB", "fp8", None),
    ("NVIDIA A10G", "bf16", 70.0), ("NVIDIA A10", "bf16", 125.0), ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.1), ("NVIDIA GeForce RTX 4090", "bf16", 165.2), ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", 112.0), ("Tesla V100-SXM2-16GB", "bf16", None), ("Some Future GPU", "bf16", None),
])
def test_the_peak_table_knows_each_gpu_by_name_and_precision(name: str, precision: str, peak: float | None) -> None:
    assert flops.table_peak(name, precision) == peak


def test_trainer_peak_tflops_wins_and_a_cpu_has_no_peak() -> None:
    cpu = torch.device("cpu")
    assert flops.device_peak(123.0, "bf16", cpu) == 123.0
    assert flops.device_peak(None, "bf16", cpu) is None


def test_mfu_is_the_achieved_tflops_per_device_over_the_peak() -> None:
    rate = flops.FlopRate(peak_tflops=50.0, world=2)
    got = rate.metrics(flops=4e12, seconds=2.0)  # 4e12 FLOPs on 2 devices in 2 s: 1 TFLOP/s each
    assert got == {"throughput/tflops": pytest.approx(1.0), "throughput/mfu": pytest.approx(0.02)}
    assert flops.FlopRate(None).metrics(4e12, 2.0) == {"throughput/tflops": pytest.approx(2.0)}
    assert flops.FlopRate(50.0).metrics(0.0, 2.0) == {}  # no FLOPs counted: nothing logged


def test_the_end_of_run_summary_prints_tflops_and_mfu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from runner.engine.engine import RunResult
    from runner.cli.launch import print_summary
    from tests.conftest import compose_spec

    spec = compose_spec([], tmp_path)
    caplog.set_level(logging.INFO, logger="runner")  # logged: the console and the run log both get it
    print_summary(spec, RunResult(0.9, {}, {}, {}, 10, 2.0, 320.0, tflops=0.25, mfu=0.0125, compile_seconds=3.5), "")
    assert "  0.25 TFLOP/s per device, MFU 1.25%\n" in caplog.text
    caplog.clear()
    print_summary(spec, RunResult(0.9, {}, {}, {}, 10, 2.0, 320.0, tflops=0.25), "")
    assert "  0.25 TFLOP/s per device, MFU unknown (set trainer.peak_tflops)\n" in caplog.text


def logged_flops_per_unit(db: Path) -> dict[int, float]:
    """Each logged step's FLOPs per unit: TFLOP/s over units/s of the same window (the same timed seconds)."""
    from tests.runner.engine.test_parallel import metric_history

    history = metric_history(db)
    rates = {name: dict(history[name]) for name in history if name.startswith("throughput/")}
    units = next(name for name in rates if name.endswith("_per_s"))
    return {step: tflops * 1e12 / rates[units][step] for step, tflops in rates["throughput/tflops"].items()}


def test_gradual_unfreezing_counts_the_frozen_and_the_unfrozen_epochs_each_at_their_own_flops(
        tmp_path: Path, sqlite_uri: str) -> None:
    """model.freeze=[1.*] until epoch 1 (issue 22, defect 12): the first layer's weight gradient is not computed
    in epoch 0, so its steps log the frozen hand count per sample, and epoch 1's the full one (52% more here)."""
    from tests.runner.engine.test_engine import tracked

    engine = tracked(["model.hidden=[16]", "model.freeze=[1.*]", "model.unfreeze_after_epochs=1", "trainer.max_epochs=2",
                      "dataset.batch_size=256", "trainer.log_every_n_steps=1", "trainer.eval_every_epoch=false",
                      "trainer.progress_bar=off"], tmp_path / "run", sqlite_uri)
    engine.fit()
    per_sample = logged_flops_per_unit(tmp_path / "mlflow.db")
    frozen, unfrozen = mlp_step_by_hand(1, [64, 16, 10], [False, True]), mlp_step_by_hand(1, [64, 16, 10])
    assert unfrozen / frozen > 1.5
    epoch = engine.steps_per_epoch
    assert sorted(per_sample) == list(range(1, 2 * epoch + 1))
    assert [per_sample[s] for s in range(1, 2 * epoch + 1)] == pytest.approx([frozen] * epoch + [unfrozen] * epoch,
                                                                              rel=1e-9)


def test_padded_text_batches_are_counted_at_their_own_length(tmp_path: Path, sqlite_uri: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Token sequences of 8 to 24 tokens padded to each batch's longest (issue 22, defect 16): each step's logged
    FLOPs are the counter's on a batch of that step's shape, not the stand-in's length scaled by tokens."""
    from tests.runner.engine.test_engine import tracked

    engine = tracked(["dataset._target_=tests.user_pkg.tokens.build_ragged", "task=language_modeling", "model=gpt",
                      "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "dataset.batch_size=4",
                      "trainer.max_steps=8", "trainer.log_every_n_steps=1", "trainer.eval_every_epoch=false",
                      "trainer.progress_bar=off", "trainer.memory_estimate=false"], tmp_path / "run", sqlite_uri)
    steps, real_step = [], engine.train_step  # each step's one micro-batch: its shape and its tokens that count

    def recording(micro_batches):
        (batch,) = micro_batches
        steps.append((tuple(batch["input_ids"].shape), int((batch["labels"] != -100).sum())))
        return real_step(micro_batches)

    monkeypatch.setattr(engine, "train_step", recording)
    engine.fit()
    assert len({shape for shape, _ in steps}) > 1  # batches of several lengths
    counted = []
    for (batch, length), _ in steps:
        ids = torch.zeros(batch, length, dtype=torch.long)
        counted.append(flops.micro_step_flops(engine.module, ids, ids, batch, engine.pass_labels))
    per_token = logged_flops_per_unit(tmp_path / "mlflow.db")
    assert sorted(per_token) == list(range(1, 9))
    # FLOPs per token logged x the step's tokens = the counter's FLOPs of that step's batch
    assert [per_token[step] * tokens for step, (_, tokens) in enumerate(steps, start=1)] == pytest.approx(counted,
                                                                                                      rel=1e-9)


def test_a_plain_tensor_batch_is_counted_once_per_shape_and_trainable_set_as_a_dict_batch_is() -> None:
    """FlopCount.of keys a plain tensor batch without walking it (the tiny step's path): its FLOPs equal the
    hand count at any batch size, a new shape or a parameter unfrozen is counted anew, and a dict batch of
    the same tensor (the general path) gives the same number."""
    from runner.tasks import Batch

    class DictNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    net = DictNet()
    count = flops.FlopCount(net, pass_labels=False)
    labels = torch.zeros(7, dtype=torch.long)
    assert count.of(Batch(torch.zeros(7, 1, 8, 8), labels)) == mlp_step_by_hand(7, [64, 32, 10])
    assert count.of(Batch(torch.zeros(3, 1, 8, 8), labels)) == mlp_step_by_hand(3, [64, 32, 10])
    assert len(count.per_sample) == 1  # one shape past the batch dimension: counted once
    assert count.of(Batch({"x": torch.zeros(3, 1, 8, 8)}, labels)) == mlp_step_by_hand(3, [64, 32, 10])
    net.body[1].requires_grad_(False)
    assert count.of(Batch(torch.zeros(3, 1, 8, 8), labels)) == mlp_step_by_hand(3, [64, 32, 10], [False, True])
    assert count.of(Batch(torch.zeros(3, 64), labels)) == mlp_step_by_hand(3, [64, 32, 10], [False, True])
    assert len(count.per_sample) == 3


def test_a_run_of_its_own_add_ons_counts_once_and_logs_the_hand_count_on_every_step_a_ragged_one_too(
        tmp_path: Path, sqlite_uri: str) -> None:
    """Where no step can change the FLOPs per sample (a tensor dataset, only the run's own add-ons), the engine takes
    FlopCount's per-sample count once and multiplies (the tiny step's path): every logged step, the epoch's ragged
    last one included, logs the hand count per sample."""
    from tests.runner.engine.test_engine import tracked

    engine = tracked(["model.hidden=[16]", "trainer.max_epochs=1", "dataset.batch_size=256", "trainer.log_every_n_steps=1",
                      "trainer.eval_every_epoch=false", "trainer.progress_bar=off"], tmp_path / "run", sqlite_uri)
    assert engine.fixed_flops
    engine.fit()
    per_sample = logged_flops_per_unit(tmp_path / "mlflow.db")
    assert engine.split_sizes["train"] % 256  # the last step's batch is ragged
    assert sorted(per_sample) == list(range(1, engine.steps_per_epoch + 1))
    assert list(per_sample.values()) == pytest.approx([mlp_step_by_hand(1, [64, 16, 10])] * engine.steps_per_epoch,
                                                      rel=1e-9)
    assert engine.steps.flops_per_sample == mlp_step_by_hand(1, [64, 16, 10])


def test_a_callback_freezing_a_layer_mid_run_logs_the_frozen_count_from_the_next_step_on(tmp_path: Path,
                                                                                         sqlite_uri: str) -> None:
    """Another's add-on may change which parameters train at any hook: with one in the run the count is looked up
    each step (no fixed count), so the steps after it froze the first layer log the frozen hand count."""
    from runner.addons.base import AddOn
    from runner.engine.engine import Engine
    from runner.tracking.tracker import build_tracker
    from tests.conftest import compose_spec

    class FreezeFirstLayer(AddOn):
        name = "freeze_first_layer"

        def setup(self, view) -> None:
            self.module = view.module

        def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> None:
            if step == 3:
                self.module[1].requires_grad_(False)

    spec = compose_spec(["model.hidden=[16]", "trainer.max_steps=6", "dataset.batch_size=256", "trainer.log_every_n_steps=1",
                         "trainer.eval_every_epoch=false", "trainer.progress_bar=off"], tmp_path / "run",
                        tracking_uri=sqlite_uri)
    engine = Engine(spec, build_tracker(spec), addons=[FreezeFirstLayer()])
    assert not engine.fixed_flops
    engine.fit()
    per_sample = logged_flops_per_unit(tmp_path / "mlflow.db")
    frozen, whole = mlp_step_by_hand(1, [64, 16, 10], [False, True]), mlp_step_by_hand(1, [64, 16, 10])
    assert [per_sample[s] for s in range(1, 7)] == pytest.approx([whole] * 3 + [frozen] * 3, rel=1e-9)
