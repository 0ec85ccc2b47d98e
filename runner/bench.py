"""`make bench`: the engine's median optimizer-step time next to a minimal hand-written loop's.

Both train the same model on the same data with the same batch, optimizer and data loader; the
engine runs with MLflow tracking on. Rounds alternate engine/hand so machine noise hits both, and
the medians of per-step wall times are compared. Numbers are printed, never asserted.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.engine import Engine, pick_device, seed_everything
from runner import components
from runner.loader import make_loader
from runner.optim import build_optimizer
from runner.registry import CONF_DIR
from runner.spec import RunSpec
from runner.tracking import build_tracker

CASES = {
    "digits mlp b64": ["dataset=digits", "model=mlp"],
    "synthetic cnn b64": ["dataset=synthetic", "model=cnn", "model.norm=false"],
}


def bench_spec(overrides: list[str], steps: int, workdir: Path) -> RunSpec:
    overrides = [*overrides, f"trainer.max_steps={steps}", "trainer.eval_every_epoch=false", "trainer.progress_bar=off",
                 f"tracking.uri=sqlite:///{workdir}/mlflow.db", f"tracking.artifact_root={workdir}/artifacts",
                 "tracking.experiment=bench"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    cfg["run_dir"] = str(workdir / "run")
    return RunSpec.from_config(cfg, tuple(overrides))


def engine_step_times(spec: RunSpec) -> list[float]:
    engine = Engine(spec, build_tracker(spec))
    stamps: list[float] = []
    on_step = engine.monitor.on_step

    def stamped(*args, **kwargs):  # after the whole step, logging included
        on_step(*args, **kwargs)
        stamps.append(time.perf_counter())

    engine.monitor.on_step = stamped
    engine.fit()
    return _diffs(stamps)


def hand_loop_step_times(spec: RunSpec) -> list[float]:
    """What a user would write: the same model, optimizer and loader; no tracking, no checks."""
    seed_everything(spec.seed, False)
    device = pick_device(spec.trainer.device)
    data = components.build_data(spec)
    model = components.build_model(spec, data).to(device)
    optimizer = build_optimizer(spec.optimizer, model, device)
    loader = make_loader(data.train, spec.dataset.batch_size, seed=spec.seed, shuffle=True, num_workers=0,
                         pin_memory=device.type == "cuda")
    stamps: list[float] = []
    epoch = 0
    while len(stamps) < spec.trainer.max_steps + 1:
        loader.batch_sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stamps.append(time.perf_counter())
            if len(stamps) > spec.trainer.max_steps:
                break
        epoch += 1
    return _diffs(stamps)


def _diffs(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating engine/hand rounds")
    parser.add_argument("--nproc", type=int, default=2, help="workers for the ddp/fsdp lines (1: skip them)")
    parser.add_argument("overrides", nargs="*", help="extra overrides for both, e.g. trainer.device=cuda")
    args = parser.parse_args()
    device = pick_device(bench_spec(args.overrides, 1, Path(".")).trainer.device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{'case':<20} {'engine ms/step':>15} {'hand ms/step':>13} {'ratio':>7}   (median of {args.rounds} x {args.steps} steps, {where}, MLflow on)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CASES.items():
            engine_times, hand_times = [], []
            for r in range(args.rounds):
                spec = bench_spec([*overrides, *args.overrides], args.steps, Path(tmp) / f"{name.replace(' ', '_')}-{r}")
                engine_times += engine_step_times(spec)[10:]  # skip warm-up steps
                hand_times += hand_loop_step_times(spec)[10:]
            e, h = statistics.median(engine_times) * 1e3, statistics.median(hand_times) * 1e3
            print(f"{name:<20} {e:>15.3f} {h:>13.3f} {e / h:>7.3f}", flush=True)
    if args.nproc > 1:
        bench_parallel(args.steps, 32, args.nproc, args.overrides)


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
