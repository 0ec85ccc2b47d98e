"""`make bench`: the engine's median optimizer-step time next to a minimal hand-written loop's.

For each workload (the tiny digits MLP and CNN, and the presets' ResNet-18 and GPT on data of their
shape) both train the same model on the same data with the same batch, optimizer, precision and data
loader, the engine with MLflow tracking on; their steps alternate within one run (benchmarks/bench_workloads.py)
and the medians of per-step wall times are compared. Where no GPU is available the presets run with
smaller batches (the table says so). Before them, the start-up times of `python -m runner` beside their
targets (benchmarks/bench_startup.py). Numbers are printed, never asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks.bench_startup import bench_startup
from benchmarks.bench_workloads import WORKLOADS, interleaved, phase_table, workload_spec
from runner.engine.parallel import pick_device

TARGET_RATIO, TARGET_FROM_MS = 1.02, 5.0  # the engine may cost at most 2% on any step of 5 ms or more
TARGET_TINY_US = 50.0  # and at most 50 us per step on a shorter one (issue 25), with MLflow on, logging as by default


def summary(engine_s: list[float], hand_s: list[float]) -> tuple[float, float, float, float]:
    """Median ms per step of engine and hand loop, their ratio, and the engine's overhead in us per step."""
    e, h = statistics.median(engine_s) * 1e3, statistics.median(hand_s) * 1e3
    return e, h, e / h, (e - h) * 1e3


def verdict(engine_ms: float, hand_ms: float, ratio: float) -> str:
    """A step under TARGET_FROM_MS is judged by the engine's overhead in us, a longer one by the ratio."""
    if hand_ms < TARGET_FROM_MS:
        return "ok" if (engine_ms - hand_ms) * 1e3 <= TARGET_TINY_US else "over"
    return "ok" if ratio <= TARGET_RATIO else "over"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per round (default: per workload)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: per workload)")
    parser.add_argument("--rounds", type=int, default=2, help="engine runs per workload (each interleaved with the hand loop)")
    parser.add_argument("--only", default="", help="only the workloads whose name contains this")
    parser.add_argument("--nproc", type=int, default=2, help="workers for the ddp/fsdp lines (1: skip them)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a busy machine)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the main thread's CPU time per step (with --threads 1; for a busy machine)")
    parser.add_argument("--startup-runs", type=int, default=3,
                        help="runs of each start-up measurement (median printed; 0: skip them)")
    parser.add_argument("--whole-runs", type=int, default=3,
                        help="whole default runs, each paired with Lightning's run of the same work (0: skip them)")
    parser.add_argument("--lightning-python", default=os.environ.get("LIGHTNING_PYTHON"),
                        help="an interpreter that imports lightning, for its whole run (default: $LIGHTNING_PYTHON, "
                             "else this one where it can)")
    parser.add_argument("--phases", action="store_true",
                        help="only where a tiny step's us go: the digits MLP's step, stretch by stretch, engine beside hand loop")
    parser.add_argument("overrides", nargs="*", help="extra overrides for both, e.g. trainer.device=cuda")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu counts the main thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.phases:
        if args.threads:
            torch.set_num_threads(args.threads)
        print_phases(args.steps or 600, time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns,
                     args.overrides)
        return
    if args.startup_runs:  # first, before this process's own training loads the machine
        bench_startup(args.startup_runs, args.whole_runs, args.lightning_python)
        print()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(workload_spec(args.overrides, 1, Path(".")).trainer.device)
    gpu = device.type == "cuda"
    where = torch.cuda.get_device_name() if gpu else f"CPU, {torch.get_num_threads()} thread(s) (no GPU: smaller preset batches)"
    print(f"{where}; MLflow on; engine and hand-loop steps alternate; median {args.clock} ms per optimizer step\n"
          f"target: ratio <= {TARGET_RATIO} on steps of {TARGET_FROM_MS:g} ms or more; on shorter steps an overhead "
          f"<= {TARGET_TINY_US:g} us per step\n")
    print(f"{'workload':<16} {'batch':>6} {'engine ms':>10} {'hand ms':>9} {'ratio':>7} {'overhead us':>12}  target")
    with tempfile.TemporaryDirectory() as tmp:
        for w in (w for w in WORKLOADS if args.only in w.name):
            overrides = [*w.overrides, *(() if gpu else w.cpu), *args.overrides]
            steps = args.steps or (w.steps if gpu else w.cpu_steps or w.steps)
            warmup = w.warmup if args.warmup is None else args.warmup
            engine_s, hand_s, batch = [], [], 0
            for r in range(args.rounds):
                spec = workload_spec(overrides, warmup + steps, Path(tmp) / f"{w.name}-{r}")
                e, h, engine = interleaved(spec, clock=clock)
                engine_s += e[warmup:]
                hand_s += h[warmup:]
                batch = engine.spec.dataset.batch_size
            e, h, ratio, overhead = summary(engine_s, hand_s)
            print(f"{w.name:<16} {batch:>6} {e:>10.3f} {h:>9.3f} {ratio:>7.3f} {overhead:>12.0f}  {verdict(e, h, ratio)}",
                  flush=True)
    if args.nproc > 1:
        bench_parallel(args.steps or 300, 32, args.nproc, args.overrides)


def print_phases(steps: int, clock, extra: list[str]) -> None:
    """The digits MLP's tiny step on the CPU, stretch by stretch (benchmarks/bench_workloads.py phase_table)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = workload_spec(["dataset=digits", "model=mlp", "trainer.device=cpu", *extra], steps + 20, Path(tmp))
        engine, hand = phase_table(spec, clock=clock)
    print(f"digits MLP, CPU, {torch.get_num_threads()} thread(s): median us of each stretch of a step "
          f"(a stretch runs from one call's edge to the next)")
    for title, stretches in (("engine", engine), ("hand loop", hand)):
        print(f"\n{title}")
        for name, us in stretches.items():
            print(f"  {name:<34} {us:8.1f}")
        print(f"  {'sum of the medians':<34} {sum(stretches.values()):8.1f}")


PARALLEL_CASE = ["dataset=synthetic", "model=cnn", "model.norm=false", "trainer.eval_every_epoch=false",
                 "trainer.progress_bar=off", "tracking=none"]


def parallel_throughput(overrides: list[str], workdir: Path) -> float:
    """Training samples/s of a real `python -m runner` run (workers and all), from its result.yaml."""
    run_dir = workdir / "run"
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={run_dir}"], cwd=workdir,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench run failed: {proc.stderr.strip().splitlines()[-1:]}")
    return yaml.safe_load((run_dir / "result.yaml").read_text())["samples_per_s"]


def bench_parallel(steps: int, batch: int, nproc: int, extra: list[str]) -> None:
    """ddp and fsdp with nproc workers against one process at the same global batch."""
    print(f"\n{'run (global batch ' + str(batch * nproc) + ')':<28} {'samples/s':>10} {'vs single':>10}   "
          f"(synthetic cnn, {steps} steps, whole run incl. start-up of the step loop)")
    base = [*PARALLEL_CASE, f"trainer.max_steps={steps}", *extra]
    with tempfile.TemporaryDirectory() as tmp:
        single = parallel_throughput([*base, f"dataset.batch_size={batch * nproc}"], Path(tmp) / "single")
        print(f"{'single, 1 process':<28} {single:>10.0f} {1.0:>10.3f}", flush=True)
        for strategy in ("ddp", "fsdp"):
            rate = parallel_throughput([*base, f"parallelism={strategy}", f"parallelism.nproc_per_node={nproc}",
                                        f"dataset.batch_size={batch}"], Path(tmp) / strategy)
            print(f"{strategy + f', {nproc} workers':<28} {rate:>10.0f} {rate / single:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
