"""What tracking costs a run (runner/tracking/writer.py): numbers, never asserted.

    python -m benchmarks.bench_tracking [--calls 2000] [--runs 3] [--before <checkout>]
    python -m benchmarks.bench_tracking --run-cost [--pairs 3] [--before <checkout>]

`--run-cost` prints only what tracking adds to a whole run: the CPU seconds (user+sys) of
`python -m runner trainer.max_epochs=1` with MLflow on an existing sqlite store minus the same run with
`tracking=none`, every process of the run counted (the launcher, its tracking process, git: the rusage of
the children this process waited for, each of which waited for its own); pairs interleaved, the median of
the pairs' differences beside the target (1.0 s). `--before` interleaves another checkout's pairs too.

1. A log call (a training step's metrics, 7 values) on a sqlite store: MLflow's synchronous
   MlflowClient.log_batch against runner's tracker, whose background writer stores it; and the
   tracker while another connection holds the store locked (a synchronous call then waits for
   sqlite's busy timeout and fails). Per call: wall and this thread's CPU time, in µs; and per step at
   the default trainer.log_every_n_steps=10.
2. Time to the first training step of `python -m runner trainer.max_steps=3` (the default digits run,
   MLflow on a sqlite store): the store opened in the background while the engine builds (as the CLI
   does), against opened when training starts; on an existing store and on a fresh one (migrated on
   first open). Wall seconds from the process's start to its first optimizer step, and the process's
   CPU seconds (user+sys) by then; runs of the cases interleaved, medians. `--before <checkout>` adds the
   same run from another checkout of runner (e.g. `git worktree add /tmp/before <commit>`).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_METRICS = {"train/loss": 0.5, "lr": 0.01, "epoch": 1.0, "throughput/samples_per_s": 1e4, "grad_norm": 1.0,
                "throughput/tflops": 0.001, "val/acc": 0.9}

# the child: times its first optimizer step; `sync` opens the store at the run's start (no background opening)
FIRST_STEP = """
import os, sys, time, runpy
import runner.cli.launch as launch
import runner.engine.engine as engine
import runner.tracking.tracker as tracker
train_step = engine.Engine.train_step
def timed(self, *args, **kwargs):
    if not getattr(timed, "seen", False):
        timed.seen = True
        t = os.times()
        print(f"FIRST_STEP {time.time():.6f} {t.user + t.system:.3f}", flush=True)
    return train_step(self, *args, **kwargs)
engine.Engine.train_step = timed
if sys.argv[1] == "sync" and "open_now" in tracker.build_tracker.__code__.co_varnames:
    build = tracker.build_tracker
    launch.build_tracker = lambda *a, **k: build(*a, **{**k, "open_now": False})
sys.argv = ["runner", *sys.argv[2:]]
runpy.run_module("runner", run_name="__main__")
"""


def migrated_store(directory: Path) -> Path:
    from mlflow.tracking import MlflowClient

    db = directory / "template.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


def per_call(fn, calls: int) -> tuple[float, float]:
    """Median wall µs per call, and this thread's CPU µs per call (total / calls)."""
    walls = []
    cpu = time.thread_time()
    for step in range(calls):
        t = time.perf_counter()
        fn(step)
        walls.append(time.perf_counter() - t)
    return statistics.median(walls) * 1e6, (time.thread_time() - cpu) / calls * 1e6


def bench_log_calls(calls: int, template: Path, tmp: Path) -> None:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from runner.specs.run import RunSpec
    from runner.specs.tracking import TrackingSpec
    from runner.tracking.tracker import build_tracker

    def fresh(name: str) -> tuple[str, Path]:
        shutil.copy(template, tmp / f"{name}.db")
        return f"sqlite:///{tmp}/{name}.db", tmp / f"{name}.db"

    print(f"1. one log call ({len(STEP_METRICS)} values), sqlite store, {calls} calls: median wall µs per call, "
          f"CPU µs per call of the training thread; per step at log_every_n_steps=10")
    uri, _ = fresh("sync")
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("bench")).info.run_id
    started = time.process_time()
    wall, cpu = per_call(lambda step: client.log_batch(
        run_id, metrics=[Metric(k, v, 0, step) for k, v in STEP_METRICS.items()]), calls)
    total = time.process_time() - started
    print(f"   {'MLflow log_batch, synchronous':<46} wall {wall:9.1f}  cpu {cpu:9.1f}  per step {wall / 10:8.1f}"
          f"   (process CPU, all threads: {total:.2f} s)")

    holder = sqlite3.connect(tmp / "sync.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    logging.getLogger("mlflow.store.db.utils").disabled = True  # its traceback of the locked file
    t = time.perf_counter()
    try:
        client.log_batch(run_id, metrics=[Metric(k, v, 0, calls) for k, v in STEP_METRICS.items()])
        outcome = "stored"
    except Exception as e:  # noqa: BLE001
        outcome = f"failed: {str(e).strip().splitlines()[0][:60]}"
    holder.execute("ROLLBACK")
    holder.close()
    print(f"   {'MLflow log_batch, synchronous, store locked':<46} wall {(time.perf_counter() - t) * 1e6:9.0f}"
          f"  (one call; {outcome})")
    for name, lock in (("runner tracker (background writer)", False), ("runner tracker, store locked", True)):
        uri, db = fresh(name.split()[-1].strip("()"))
        spec = RunSpec(run_dir=str(tmp / f"run-{db.stem}"), tracking=TrackingSpec(uri=uri, artifact_root=str(tmp / "art")))
        tracker = build_tracker(spec)
        tracker.start(spec)
        tracker.flush()
        holder = None
        if lock:
            holder = sqlite3.connect(db, isolation_level=None)
            holder.execute("BEGIN EXCLUSIVE")
        started = time.process_time()
        wall, cpu = per_call(lambda step: tracker.log_metrics(STEP_METRICS, step), calls)
        if holder is not None:
            holder.execute("ROLLBACK")
            holder.close()
        drained = time.perf_counter()
        tracker.finish("FINISHED")
        drained = time.perf_counter() - drained
        total = time.process_time() - started
        stored = len(MlflowClient(uri).get_metric_history(tracker.run_id, "train/loss"))
        print(f"   {name:<46} wall {wall:9.1f}  cpu {cpu:9.1f}  per step {wall / 10:8.1f}"
              f"   (process CPU, all threads: {total:.2f} s; finish waited {drained:.2f} s; {stored}/{calls} steps stored)")


def first_step(tree: Path, variant: str, store: str, cwd: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'sweeper'}"}
    run_dir = cwd / f"run-{time.monotonic_ns()}"
    started = time.time()
    out = subprocess.run([sys.executable, "-c", FIRST_STEP, variant, "trainer.max_steps=3", "trainer.progress_bar=off",
                          f"tracking.uri={store}", f"tracking.artifact_root={cwd / 'artifacts'}",
                          f"hydra.run.dir={run_dir}"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    line = next((line for line in out.stdout.splitlines() if line.startswith("FIRST_STEP ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{tree} {variant}: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    _, at, cpu = line.split()
    return float(at) - started, float(cpu)


def bench_first_step(runs: int, template: Path, tmp: Path, before: Path | None) -> None:
    cases = [("store opened in the background (CLI)", REPO, "background"),
             ("store opened when training starts", REPO, "sync")]
    if before is not None:
        cases.append((f"before: {before}", before, "sync"))
    print(f"2. python -m runner trainer.max_steps=3 (digits MLP, MLflow on sqlite): to the first optimizer step; "
          f"median of {runs}, cases interleaved")
    for store_kind in ("existing store", "fresh store"):
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
        for i in range(runs):
            for name, tree, variant in cases:
                db = tmp / f"first-{time.monotonic_ns()}.db"
                if store_kind == "existing store":
                    shutil.copy(template, db)
                times[name].append(first_step(tree, variant, f"sqlite:///{db}", tmp))
        print(f"   {store_kind}:")
        for name, _, _ in cases:
            wall = statistics.median(t for t, _ in times[name])
            cpu = statistics.median(c for _, c in times[name])
            each = " ".join(f"{t:.2f}" for t, _ in times[name])
            print(f"     {name:<44} wall {wall:6.2f} s  cpu {cpu:6.2f} s   (each: {each})", flush=True)


RUN_COST_TARGET_S = 1.0  # CPU seconds tracking may add to a run (issue 36)


def run_cpu(tree: Path, cwd: Path, extra: list[str]) -> float:
    """CPU seconds (user+sys) of a 1-epoch default run from `tree`, every process of it counted."""
    import resource

    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'sweeper'}", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's runs find their bytecode cached
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "runner", "trainer.max_epochs=1", "trainer.progress_bar=off", *extra],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bench_run_cost(pairs: int, tmp: Path, before: Path | None) -> None:
    trees = [("this checkout", REPO)] + ([(f"before: {before}", before)] if before is not None else [])
    print(f"CPU that tracking adds to `python -m runner trainer.max_epochs=1` (MLflow on an existing sqlite store "
          f"minus tracking=none, every process counted): median of {pairs} interleaved pairs")
    cwds = {}
    for name, tree in trees:
        cwds[name] = tmp / f"cost-{len(cwds)}"
        cwds[name].mkdir()
        run_cpu(tree, cwds[name], [])  # untimed: creates and migrates the store, as a user's first run does
    cost: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in trees}
    for _ in range(pairs):
        for name, tree in trees:
            cost[name].append((run_cpu(tree, cwds[name], []), run_cpu(tree, cwds[name], ["tracking=none"])))
    for name, _ in trees:
        added = statistics.median(m - n for m, n in cost[name])
        verdict = "ok" if added <= RUN_COST_TARGET_S else "over"
        each = " ".join(f"{m:.2f}/{n:.2f}" for m, n in cost[name])
        print(f"   {name:<44} +{added:5.2f} s  target <= {RUN_COST_TARGET_S:.1f}: {verdict}   "
              f"(MLflow/none CPU s per pair: {each})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", type=Path, default=None, help="another checkout of runner to time the first step of")
    parser.add_argument("--skip-first-step", action="store_true")
    parser.add_argument("--run-cost", action="store_true", help="only the CPU tracking adds to a whole 1-epoch run")
    parser.add_argument("--pairs", type=int, default=3, help="--run-cost: interleaved pairs (median printed)")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if args.run_cost:
            bench_run_cost(args.pairs, tmp, args.before)
            load = os.getloadavg()
            print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
            return
        template = migrated_store(tmp)
        bench_log_calls(args.calls, template, tmp)
        if not args.skip_first_step:
            bench_first_step(args.runs, template, tmp, args.before)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
