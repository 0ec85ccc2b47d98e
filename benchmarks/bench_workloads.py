"""The workloads `make bench` times, the minimal hand-written loop each is compared with, and the
interleaved timing of the two.

Engine and hand loop run in one process, in blocks of steps that alternate (one step each by default):
the hand loop's block runs inside the engine's step hook, right after an engine step, so machine noise
(other processes, frequency changes) hits both alike, far better than whole runs taking turns. On a GPU
each block ends with a synchronize, so a block's time is the device's time for it.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.engine import components
from runner.engine.run_data import build_data
from runner.engine.engine import Engine
from runner.engine.loader import make_loader, on_device
from runner.engine.optim import build_optimizer
from runner.engine.parallel import pick_device
from runner.specs.registry import CONF_DIR
from runner.engine.rng import seed_everything
from runner.specs.run import RunSpec
from runner.tasks import IGNORE
from runner.tracking.tracker import build_tracker


@dataclass(frozen=True)
class Workload:
    name: str
    overrides: tuple[str, ...]
    steps: int                      # timed steps, after `warmup` more
    warmup: int = 10
    cpu: tuple[str, ...] = ()       # where no GPU: smaller shapes, so that the CPU bench ends in minutes
    cpu_steps: int | None = None


# the presets' own workloads, on data of their shape: no download is possible (synthetic images for
# CIFAR-10; the offline corpus for GPT)
WORKLOADS = [
    Workload("digits mlp", ("dataset=digits", "model=mlp"), 300),
    Workload("synthetic cnn", ("dataset=synthetic", "model=cnn", "model.norm=false"), 100, cpu_steps=60),
    Workload("cifar10_resnet", ("experiment=cifar10_resnet", "dataset=synthetic", "dataset.shape=[3,32,32]",
                                "dataset.num_classes=10", "dataset.size=8192", "dataset.num_workers=0",
                                "trainer.channels_last=true"), 100,
             cpu=("dataset.batch_size=16", "dataset.size=1024", "precision=fp32"), cpu_steps=12, warmup=3),
    Workload("gpt_small", ("experiment=gpt_small", "trainer.eval_every_n_steps=0"), 100, cpu_steps=60),
]


def workload_spec(overrides: list[str], steps: int, workdir: Path) -> RunSpec:
    """The run spec of a workload, `steps` long, evaluating never, tracked in its own MLflow store."""
    workdir.mkdir(parents=True, exist_ok=True)  # a store's folder must exist (runner makes only the default's)
    overrides = [*overrides, f"trainer.max_steps={steps}", "trainer.eval_every_epoch=false", "trainer.progress_bar=off",
                 f"tracking.uri=sqlite:///{workdir}/mlflow.db", f"tracking.artifact_root={workdir}/artifacts",
                 "tracking.experiment=bench"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    cfg["run_dir"] = str(workdir / "run")
    return RunSpec.from_config(cfg, tuple(overrides))


def hand_steps(spec: RunSpec) -> Iterator[None]:
    """What a user would write for the same work: the same model, optimizer, loader, precision, clipping
    and a schedule, with no tracking and no checks. Yields after each optimizer step."""
    seed_everything(spec.seed, False)
    device = pick_device(spec.trainer.device)
    data = build_data(spec)
    model = components.build_model(spec, data).to(device)
    if spec.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(spec.optimizer, model, device)
    schedule = None
    if not spec.scheduler.target.endswith(".constant"):
        total = spec.trainer.max_steps or 1
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / total, 1))))
    forward = torch.compile(model) if spec.trainer.compile else model
    loader = make_loader(on_device(data.train, device), spec.dataset.batch_size, seed=spec.seed, shuffle=True,
                         num_workers=spec.dataset.num_workers, pin_memory=device.type == "cuda", collate=data.collate)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision.name)
    smoothing, clip = spec.task.get("label_smoothing", 0.0), spec.trainer.clip_grad_norm
    epoch = 0
    while True:
        loader.batch_sampler.set_epoch(epoch)
        for batch in loader:
            inputs, labels = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else batch
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
                logits = forward(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE,
                                   label_smoothing=smoothing)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            if schedule is not None:
                schedule.step()
            optimizer.zero_grad(set_to_none=True)
            yield
        epoch += 1


def interleaved(spec: RunSpec, block: int = 1, hand: Callable[[RunSpec], Iterator[None]] = hand_steps,
                clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], list[float], Engine]:
    """Seconds per step of the engine (MLflow on) and of the hand loop, per block of `block` steps,
    the blocks alternating within one engine run; warm-up blocks included (the caller drops them).
    `clock`: wall time, or time.thread_time (this thread's CPU time: on a CPU with one torch thread,
    the work of a step without the time other processes took the core)."""
    engine = Engine(spec, build_tracker(spec))
    loop = hand(engine.spec)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine_times: list[float] = []
    hand_times: list[float] = []
    since: list[float] = []
    on_step = engine.monitor.on_step

    def stamped(step: int, *args, **kwargs) -> None:  # after the engine's whole step, logging included
        on_step(step, *args, **kwargs)
        if step % block:  # a ragged last block is not timed
            return
        sync()
        now = clock()
        if since:
            engine_times.append((now - since[0]) / block)
        for _ in range(block):
            next(loop)
        sync()
        since[:] = [clock()]
        hand_times.append((since[0] - now) / block)

    engine.monitor.on_step = stamped
    sync()
    since.append(clock())
    engine.fit()
    return engine_times, hand_times, engine


def phase_table(spec: RunSpec, skip: int = 20, clock: Callable[[], int] = time.perf_counter_ns
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Where a tiny step's microseconds go: median us of each stretch of the engine's step between the
    calls it makes (the parts' own methods wrapped with a clock), and of the hand loop's (timed inline),
    steps interleaved as in `interleaved`. Each stretch also carries a clock read (~0.1-0.5 us)."""
    engine = Engine(spec, build_tracker(spec))
    marks: list[tuple[str, int]] = []

    def wrap(obj, name: str, label: str) -> None:
        call = getattr(obj, name)

        def timed(*args, **kwargs):
            marks.append((label + ">", clock()))
            out = call(*args, **kwargs)
            marks.append((label + "<", clock()))
            return out
        setattr(obj, name, timed)

    for obj, name, label in ((engine, "train_step", "train_step"), (engine, "_count", "count"),
                             (engine, "_prepare", "prepare"), (engine.steps, "_micro_step_flops", "flops"),
                             (engine.steps, "_loss_sum", "forward+loss"), (engine.precision, "backward", "backward"),
                             (engine.steps, "_clip_gradients", "clip"), (engine.precision, "step", "optimizer"),
                             (engine.schedule, "step", "schedule"), (engine.optimizer, "zero_grad", "zero_grad"),
                             (engine.monitor, "step_starts", "step_starts"), (engine.monitor, "on_step", "monitor"),
                             (engine.addons, "on_step_end", "addons")):
        wrap(obj, name, label)
    hand_marks: list[tuple[str, int]] = []
    engine_stretches: dict[str, list[int]] = {}
    hand_stretches: dict[str, list[int]] = {}

    def collect(points: list[tuple[str, int]], into: dict[str, list[int]]) -> None:
        for (a, ta), (b, tb) in zip(points, points[1:]):
            into.setdefault(f"{a} .. {b}", []).append(tb - ta)

    def hand_loop() -> Iterator[None]:
        seed_everything(spec.seed, False)
        data = build_data(spec)
        model = components.build_model(spec, data)
        optimizer = build_optimizer(spec.optimizer, model, torch.device("cpu"))
        loader = make_loader(data.train, spec.dataset.batch_size, seed=spec.seed, shuffle=True, num_workers=0,
                             pin_memory=False, collate=data.collate)
        epoch = 0
        while True:
            loader.batch_sampler.set_epoch(epoch)
            batches = iter(loader)
            while True:
                hand_marks.append(("loader>", clock()))
                batch = next(batches, None)
                if batch is None:
                    break
                hand_marks.append(("loader<", clock()))
                inputs, labels = batch
                loss = F.cross_entropy(model(inputs), labels, ignore_index=IGNORE)
                hand_marks.append(("forward+loss<", clock()))
                loss.backward()
                hand_marks.append(("backward<", clock()))
                optimizer.step()
                hand_marks.append(("optimizer<", clock()))
                optimizer.zero_grad(set_to_none=True)
                hand_marks.append(("zero_grad<", clock()))
                yield
            epoch += 1

    loop = hand_loop()
    on_step = engine.monitor.on_step

    def stamped(step: int, *args, **kwargs) -> None:  # the engine's step ends with the monitor; the hand's follows
        on_step(step, *args, **kwargs)
        if step > skip:
            collect(marks, engine_stretches)
        hand_marks[:] = [("start", clock())]
        next(loop)
        hand_marks.append(("end", clock()))
        if step > skip:
            collect(hand_marks, hand_stretches)
        marks[:] = [("hand step done", clock())]

    engine.monitor.on_step = stamped
    engine.fit()
    # a stretch seen on most steps (not only log steps, nor an epoch's first)
    least = (spec.trainer.max_steps - skip) // 2
    return ({k: statistics.median(v) / 1e3 for k, v in engine_stretches.items() if len(v) >= least},
            {k: statistics.median(v) / 1e3 for k, v in hand_stretches.items() if len(v) >= least})
