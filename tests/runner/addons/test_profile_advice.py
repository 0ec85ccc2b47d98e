"""The profiler's analysis on given figures: each piece of advice appears exactly when its measured figure
crosses its threshold, and quotes that figure."""
from __future__ import annotations

import pytest

from runner.addons import profile_advice as pa
from runner.addons.profile_advice import Figures, Setup

BALANCED = {"data": 0.05, "rank_sync": 0.0, "to_device": 0.02, "forward": 0.30, "backward": 0.50, "optimizer": 0.08}


def figures(window_s: float = 1.0, **changes) -> Figures:
    """A one-second window of 4 steps, balanced unless `changes` says otherwise (phase seconds or Figures fields)."""
    phases = {**BALANCED, **{k: v for k, v in changes.items() if k in BALANCED}}
    rest = {k: v for k, v in changes.items() if k not in BALANCED}
    return Figures(steps=4, window_s=window_s, phase_s=phases, **rest)


def test_a_data_bound_window_is_advised_more_workers_with_its_measured_share() -> None:
    fig = figures(data=0.41, forward=0.2, backward=0.3)
    advice = pa.advise(fig, Setup(num_workers=0, cpus=8))
    assert advice == ["data loading is 41% of step time: raise dataset.num_workers (now 0; this machine has 8 CPUs)"]
    # as many workers as CPUs already: more would not help, the samples themselves are slow
    assert pa.advise(fig, Setup(num_workers=8, cpus=8)) == [
        "data loading is 41% of step time: make the dataset's __getitem__ cheaper (dataset.num_workers is 8 already, "
        "as many as the 8 CPUs)"]


@pytest.mark.parametrize("share, advised", [(pa.DATA_SHARE - 0.01, False), (pa.DATA_SHARE, True)])
def test_the_workers_advice_follows_the_threshold(share: float, advised: bool) -> None:
    advice = pa.advise(figures(data=share), Setup())
    assert any("dataset.num_workers" in line for line in advice) == advised


@pytest.mark.parametrize("setup, compute, advised", [
    (Setup(device="cuda", bf16_supported=True, precision="fp32"), 0.8, True),
    (Setup(device="cuda", bf16_supported=True, precision="tf32"), 0.8, True),
    (Setup(device="cuda", bf16_supported=True, precision="bf16"), 0.8, False),     # mixed precision already
    (Setup(device="cuda", bf16_supported=False, precision="fp32"), 0.8, False),    # e.g. a V100
    (Setup(device="cpu", precision="fp32"), 0.8, False),
    (Setup(device="cuda", bf16_supported=True, precision="fp32"), pa.COMPUTE_SHARE - 0.01, False),  # not compute-bound
])
def test_bf16_is_advised_only_to_a_compute_bound_fp32_run_on_a_gpu_that_runs_it(setup: Setup, compute: float,
                                                                                advised: bool) -> None:
    fig = figures(forward=compute / 2, backward=compute / 2)
    lines = [line for line in pa.advise(fig, setup) if "precision=bf16" in line]
    assert lines == ([f"forward and backward are {round(compute * 100)}% of step time in {setup.precision}, on a GPU "
                      f"that supports bf16: try precision=bf16 (mixed precision)"] if advised else [])


def test_gpu_idle_time_comes_from_the_kernels_busy_time_and_advises_cuda_graphs() -> None:
    setup = Setup(device="cuda", bf16_supported=True, precision="bf16", compile="off")
    fig = figures(gpu_busy_s=0.6)
    assert fig.gpu_idle == pytest.approx(0.4)
    assert ("the GPU is idle between kernels 40% of the window: try trainer.compile=reduce-overhead (CUDA graphs "
            "launch the step's kernels at once; now off)") in pa.advise(fig, setup)
    graphs = pa.advise(fig, Setup(device="cuda", precision="bf16", compile="reduce-overhead", batch_size=32))
    assert any("idle between kernels 40%" in line and "raise dataset.batch_size (now 32)" in line for line in graphs)
    assert not any("idle" in line for line in pa.advise(figures(gpu_busy_s=1 - pa.GPU_IDLE + 0.01), setup))
    assert figures().gpu_idle is None  # no GPU: no figure, no advice


@pytest.mark.parametrize("setup, fix", [
    (Setup(device="cpu", optimizer_kernel="for_loop", kernels_offered=("fused", "foreach", "for_loop")),
     "try optimizer.impl=foreach (now for_loop)"),  # runner/engine/optim.py: fused is not the fast path on a CPU
    (Setup(device="cuda", optimizer_kernel="foreach", kernels_offered=("fused", "foreach", "for_loop")),
     "try optimizer.impl=fused (now foreach)"),
    (Setup(device="cpu", optimizer_kernel="foreach", kernels_offered=("fused", "foreach", "for_loop"), accumulation=2,
           batch_size=16),
     "it runs the foreach kernel already; raise accumulation.steps (now 2) or dataset.batch_size (now 16)"),
])
def test_a_slow_optimizer_step_is_advised_the_faster_kernel_the_class_offers(setup: Setup, fix: str) -> None:
    advice = pa.advise(figures(optimizer=0.3, backward=0.28), setup)
    assert len(advice) == 1 and advice[0].startswith(f"the optimizer step is 30% of step time: {fix}")
    assert pa.advise(figures(optimizer=pa.OPTIMIZER_SHARE - 0.01), setup) == []


def test_communication_and_waiting_ranks_are_advised_only_with_several_ranks() -> None:
    fig = figures(communication_s=0.3, rank_sync=0.2, backward=0.3)
    advice = pa.advise(fig, Setup(parallelism="ddp", world=2, accumulation=1, batch_size=8))
    assert advice[0].startswith("communication (ddp, 2 ranks) is 30% of step time: raise accumulation.steps (now 1;")
    assert advice[1].startswith("the step's small collectives outside backward (its sample count, the ranks' "
                                "stop vote) take 20% of step time")
    assert pa.advise(fig, Setup()) == []  # one process: these figures mean nothing to change
    # FSDP gathers the parameters for every micro-step: accumulation would not cut that
    [fsdp, _] = pa.advise(fig, Setup(parallelism="fsdp", world=2, accumulation=1, batch_size=8))
    assert fsdp.startswith("communication (fsdp, 2 ranks) is 30% of step time: raise dataset.batch_size (now 8)")
    assert "accumulation" not in fsdp


def test_collectives_between_the_phases_count_as_waiting_for_ranks_not_as_loop_overhead() -> None:
    """The ranks' per-step vote lies outside every phase, in "other": where one rank waits for a slower one."""
    fig = figures(rank_sync=0.1, forward=0.1, backward=0.2, between_comm_s=0.3)  # other: 0.45, 0.3 of it collectives
    advice = pa.advise(fig, Setup(parallelism="ddp", world=2))
    assert len(advice) == 1 and advice[0].startswith("the step's small collectives outside backward (its sample count, "
                                                     "the ranks' stop vote) take 40% of step time")
    assert "    collectives        30%  (of other" in pa.report(fig, Setup(parallelism="ddp", world=2), first_step=0)
    loop = pa.advise(figures(rank_sync=0.1, forward=0.1, backward=0.2), Setup(parallelism="ddp", world=2))
    assert any(line.startswith("45% of step time is spent between the phases") for line in loop)


def test_the_costliest_advice_comes_first_and_a_healthy_window_gets_none() -> None:
    setup = Setup(device="cpu", optimizer_kernel="for_loop", kernels_offered=("foreach", "for_loop"))
    advice = pa.advise(figures(data=0.2, optimizer=0.3, forward=0.1, backward=0.1), setup)
    assert [line.split(" is ")[0] for line in advice] == ["the optimizer step", "28% of step time", "data loading"]
    text = pa.report(figures(), Setup(), first_step=5)
    assert text.endswith("advice: none; no figure crossed its threshold (runner/addons/profile_advice.py)")


def test_the_report_shows_every_phase_and_the_shares_add_up() -> None:
    fig = figures(window_s=0.5)  # 4 steps: 125 ms each; the phases take 0.95 s of a 0.5 s window
    shares = fig.shares()
    assert shares["other"] == 0.0 and shares["forward"] == pytest.approx(0.6)
    fig = figures(window_s=2.0)
    assert sum(fig.share(p) for p in (*pa.PHASES, "other")) == pytest.approx(1.0)
    text = pa.report(fig, Setup(), first_step=5)
    assert text.splitlines()[0] == "profile of 4 optimizer step(s) (steps 6-9, rank 0, cpu): 500.00 ms per step"
    for line in ("  waiting for data      2%", "  forward              15%", "  other                52%"):
        assert line in text
    assert "waiting for ranks" not in text  # one process
