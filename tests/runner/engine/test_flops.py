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
    rate = flops.FlopRate(flops_per_unit=1e9, peak_tflops=50.0, world=2)
    got = rate.metrics(units=4000, seconds=2.0)  # 4e12 FLOPs on 2 devices in 2 s: 1 TFLOP/s each
    assert got == {"throughput/tflops": pytest.approx(1.0), "throughput/mfu": pytest.approx(0.02)}
    assert flops.FlopRate(1e9, None).metrics(4000, 2.0) == {"throughput/tflops": pytest.approx(2.0)}
    assert flops.FlopRate(None, 50.0).metrics(4000, 2.0) == {}


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
