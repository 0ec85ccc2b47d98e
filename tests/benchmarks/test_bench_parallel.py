"""benchmarks/bench_parallel.py: the arithmetic behind its table (the pipeline bubble's theory and measure, step
times from logged throughput, ratios beside one process) and the cases it runs; figures are never asserted."""
from __future__ import annotations

import pytest

from benchmarks.bench_parallel import (Row, bubble_theory, cases, measured_bubble, one_line, step_seconds, table)


def test_the_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1() -> None:
    assert bubble_theory(2, 4) == pytest.approx(1 / 5)
    assert bubble_theory(4, 8) == pytest.approx(3 / 11)
    assert bubble_theory(4, 1) == pytest.approx(3 / 4)  # one micro-batch: a stage works a quarter of the step
    assert bubble_theory(1, 8) == 0.0


def test_the_measured_bubble_is_the_pipeline_step_beyond_one_process_split_over_the_stages() -> None:
    # one process takes 100 ms; 2 stages at 62.5 ms: 50 ms of each is the work, 12.5 ms of it idle (20%)
    assert measured_bubble(0.100, 0.0625, 2) == pytest.approx(0.2)
    assert measured_bubble(0.100, 0.050, 2) == pytest.approx(0.0)  # a perfect split: no bubble


def test_step_time_is_the_median_of_the_global_batch_over_each_steps_throughput() -> None:
    # 1024 tokens a step; the first (warm-up) step is left out; median of 10, 8, 20 ms
    assert step_seconds([100.0, 102400.0, 128000.0, 51200.0], 1024, 1) == pytest.approx(0.010)
    assert step_seconds([1024.0], 1024, 5) == pytest.approx(1.0)  # fewer steps than warm-up: all of them


def test_the_table_sets_each_case_beside_one_process() -> None:
    one = Row("one process", 1, 0.100)
    rows = [Row("ddp, 2 processes", 2, 0.060), Row("pp=2 1f1b, m=4", 2, 0.0625, bubble=(0.2, 0.2)),
            Row("tp=2", 2, skipped="error: parallelism.tp_plan: ...")]
    header, base, ddp, pp, tp = table(one, rows)
    assert header.split()[:5] == ["case", "procs", "step", "ms", "vs"]
    assert base.split()[-2:] == ["100.0", "1.00"]
    assert ddp.split()[-2:] == ["60.0", "0.60"]
    assert pp.split()[-5:] == ["62.5", "0.62", "0.20", "/", "0.20"]
    assert tp.split()[:4] == ["tp=2", "2", "skipped", "error:"]


def test_the_cases_keep_the_global_batch_and_add_fsdp_by_tp_at_four_processes() -> None:
    two = {c.name: c for c in cases(2, 4)}
    assert list(two) == ["ddp, 2 processes", "fsdp, 2 processes", "tp=2", "pp=2 gpipe, m=4", "pp=2 1f1b, m=4"]
    assert [(c.processes, c.dp) for c in two.values()] == [(2, 2), (2, 2), (2, 1), (2, 1), (2, 1)]
    assert "parallelism.pp_microbatches=4" in two["pp=2 gpipe, m=4"].overrides
    four = {c.name: c for c in cases(4, 8)}
    assert (four["fsdp x tp=2, 4 processes"].processes, four["fsdp x tp=2, 4 processes"].dp) == (4, 2)


def test_a_failed_run_is_told_by_its_own_error_line() -> None:
    assert one_line("W1126 noise\nerror: parallelism.tp: 2 ...\n") == "error: parallelism.tp: 2 ..."
    assert one_line("Traceback\n  File x\nValueError: boom\n") == "ValueError: boom"
    assert one_line("") == "failed without a message"
