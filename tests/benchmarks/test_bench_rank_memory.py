"""benchmarks/bench_rank_memory.py: the arithmetic behind its table (the training state, the ideal, the targets),
which process is which rank, and the exit hook every process of a measured run loads. Peaks themselves are
never asserted: they depend on the machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import bench_rank_memory as bench

MiB = 2**20


def test_the_training_state_and_the_ideal_per_rank() -> None:
    # GPT-2 124M at the benchmark's shape: vocabulary 50304, 64 positions (wpe 64 x 768), the lm head tied
    assert bench.parameter_count(bench.MODELS["gpt2"]) == 123_738_624
    assert bench.parameter_count(bench.MODELS["gpt2_medium"]) == 353_888_256  # 24 x 1024, 16 heads
    state = bench.training_state_bytes(123_738_624)
    assert state == 123_738_624 * (4 + 4 + 8)
    assert bench.ideal_bytes(state, 4, 800 * MiB) == state // 4 + 800 * MiB
    assert [bench.verdict(r, 0.65) for r in (0.5, 0.65, 0.66)] == ["met", "met", "missed"]
    assert bench.verdict(1.0, None) == ""  # one process: the reference
    assert {k: c.target for k, c in bench.CASES.items()} == {"single": None, "fsdp2": 0.65, "fsdp4": 0.45,
                                                            "tp2": 0.7, "pp2": 0.7}


def test_ranks_are_read_from_the_processes_environment_and_the_exit_records() -> None:
    # one process: the run's own process is rank 0; a helper process without RANK (a loader worker) is not a rank
    one = bench.rank_peaks(10, {10: (None, 900 * MiB), 11: (None, 50 * MiB)}, {10: {"rank": None, "vmhwm": 950 * MiB}}, 1.0)
    assert one.ranks == {0: 950 * MiB} and one.kind == "resident"
    # workers: RANK in their environment, the launcher apart; the higher of sampled and exit-time figures
    many = bench.rank_peaks(10, {10: (None, 800 * MiB), 12: (0, 700 * MiB), 13: (1, 720 * MiB)},
                            {12: {"rank": "0", "vmhwm": 710 * MiB}, 13: {"rank": "1", "vmhwm": 690 * MiB}}, 1.0)
    assert many.ranks == {-1: 800 * MiB, 0: 710 * MiB, 1: 720 * MiB}
    # CUDA: each rank's max allocated, the resident figures left out
    cuda = bench.rank_peaks(10, {12: (0, 700 * MiB)}, {12: {"rank": "0", "vmhwm": 700 * MiB, "cuda_max_allocated": 5 * MiB},
                                                     10: {"rank": None, "vmhwm": 800 * MiB}}, 1.0)
    assert cuda.kind == "cuda allocated" and cuda.ranks == {-1: 0, 0: 5 * MiB}


def test_every_process_of_a_measured_run_records_its_peak_at_exit(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(bench.HOOK), "RUNNER_BENCH_PEAKS": str(tmp_path), "RANK": "3"}
    done = subprocess.run([sys.executable, "-c", "x = bytearray(64 * 2**20); x[::4096] = b'1' * len(x[::4096])"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert record["rank"] == "3" and record["vmhwm"] > 64 * MiB and "cuda_max_allocated" not in record
