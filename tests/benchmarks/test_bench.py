"""benchmarks/bench.py, benchmarks/bench_workloads.py, benchmarks/bench_gpu.py: the arithmetic behind the printed
figures, and that a tiny run prints its table (figures are never asserted: they depend on the machine)."""
from __future__ import annotations

import pytest

from benchmarks.bench import summary, verdict
from benchmarks.bench_gpu import flops_per_token, gpt_flops_per_token


def test_gpt_flops_count_tied_weights_once_without_the_position_embedding() -> None:
    from runner.models.gpt import GPT

    vocab, context, layers, heads, width = 100, 16, 2, 2, 32
    model = GPT(vocab, context, n_layer=layers, n_head=heads, n_embd=width)
    # token embedding (= lm head) + per block 12 d^2 + 13 d (qkv, proj, fc, proj with biases; two LayerNorms) + ln_f
    n = vocab * width + layers * (12 * width**2 + 13 * width) + 2 * width
    assert gpt_flops_per_token(model, context) == 6 * n + 12 * layers * heads * (width // heads) * context
    # GPT-2 124M at vocab 50304: 123.69M parameters without wpe (nanoGPT's count), 855 MFLOP per token at 1024
    assert flops_per_token(123_689_472, 12, 12, 64, 1024) == pytest.approx(855.3e6, rel=1e-3)


def test_ratio_overhead_and_target_verdict() -> None:
    engine_ms, hand_ms, ratio, overhead_us = summary([0.0102, 0.0100, 0.0500], [0.0100, 0.0098, 0.0001])
    assert (engine_ms, hand_ms) == pytest.approx((10.2, 9.8))  # medians, the outliers ignored
    assert ratio == pytest.approx(10.2 / 9.8) and overhead_us == pytest.approx(400.0)
    assert verdict(10.2, 10.0, 1.02) == "ok" and verdict(10.3, 10.0, 1.03) == "over"
    # under 5 ms the overhead in us is judged, not the ratio: at most 50 us
    assert verdict(1.3, 1.0, 1.3) == "over" and verdict(1.04, 1.0, 1.04) == "ok"


def test_a_tiny_bench_run_prints_its_table(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import bench

    bench.main(["--steps", "3", "--warmup", "1", "--rounds", "1", "--only", "digits", "--nproc", "1", "--startup-runs", "0",
                "tracking=none"])
    out = capsys.readouterr().out
    header, row = out.strip().splitlines()[-2:]
    assert header.split() == ["workload", "batch", "engine", "ms", "hand", "ms", "ratio", "overhead", "us", "target"]
    name, batch, engine_ms, hand_ms, ratio, overhead, target = row.rsplit(None, 6)
    assert name == "digits mlp" and batch == "64" and target in ("ok", "over")  # machine-dependent
    assert float(ratio) == pytest.approx(float(engine_ms) / float(hand_ms), abs=2e-3)


def test_the_gpu_bench_without_a_gpu_says_so_and_reports_tokens_per_second(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import bench_gpu

    bench_gpu.main(["--only", "gpt", "--steps", "2", "--warmup", "1", "--gpt-batch", "2"])
    out = capsys.readouterr().out
    assert out.startswith("device: cpu (no GPU): small shapes")
    assert "tokens/s" in out and "MFU n/a (no peak FLOP/s known for this device)" in out
