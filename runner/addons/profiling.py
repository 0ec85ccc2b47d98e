"""`trainer.profile=true`: profiles a window of training steps with torch.profiler.

The window skips `trainer.profile_skip_steps` first steps (warm-up, compilation, the loader's first
batches), then measures `trainer.profile_steps` steps: each phase of the step (waiting for data, batch to
device, forward, backward, optimizer), and the torch.profiler trace, from which communication,
host-to-device copies and the GPU's idle time come. On a CPU a phase is wall time. On a GPU it is the
stream's time between the phase's edges, recorded as CUDA events and read when the window closes:
synchronising the device at every edge (as this did before) drained the queue a dozen times a step, so
the GPU idled while the host refilled it, and the window showed idle time (29% for GPT-2 124M on an
H200) that a run without the profiler does not have. "Waiting for data" on a GPU is the time the stream
waited for the next batch.
Every rank writes its own trace (Chrome trace JSON: https://ui.perfetto.dev, or TensorBoard's profiler
plugin) to <run_dir>/profile/; the main rank logs the shares to MLflow and prints the report with its
advice (runner/addons/profile_advice.py).

With profiling off the engine holds a `NoProfiler`: its phases are one shared no-op context each and
its step iterator is the loader's own, so a run pays nothing per step. Both are add-ons
(runner/addons/base.py) besides: the report comes at the end of training (`on_train_end`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from runner.addons import profile_advice
from runner.addons.base import AddOn, EngineView
from runner.engine.optim import fused_kernel_runs, kernels
from runner.engine.parallel import DistEnv
from runner.specs.run import RunSpec

log = logging.getLogger(__name__)

_OFF = contextlib.nullcontext()  # reusable: entering it has no state
# Collectives as torch.profiler names them: c10d ops (c10d::allreduce_, gloo:all_reduce, nccl:all_reduce, and
# record_param_comms around them) and NCCL kernels (ncclDevKernel_AllReduce_...). By namespace, not by words
# like "broadcast": aten::broadcast_tensors is arithmetic.
_COMMUNICATION = re.compile(r"^(c10d::|gloo:|nccl|record_param_comms)")
_END = object()


class Phases:
    """The step's phases as the engine's train_step enters them (`with phases.forward:`)."""

    __slots__ = ("rank_sync", "to_device", "forward", "backward", "optimizer")

    def __init__(self, make: Callable[[str], contextlib.AbstractContextManager]):
        for name in self.__slots__:
            setattr(self, name, make(name))


OFF = Phases(lambda name: _OFF)


class NoProfiler(AddOn):
    """Profiling off: nothing per step."""

    name = "profiler"
    phase = OFF
    profiling = False  # whether the step now running is in the window (its time is not throughput)

    def steps(self, groups: Iterable) -> Iterable:
        return groups

    def finish(self) -> None:
        pass


class _WallClock:
    """Phase edges in wall time (a CPU, where kernels run as they are called)."""

    def __init__(self, totals: dict[str, float]):
        self.totals = totals

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, name: str, started: float) -> None:
        self.totals[name] += time.perf_counter() - started

    def settle(self) -> None:
        pass


class _StreamClock:
    """Phase edges as CUDA events on the current stream, read once when the window closes: a phase's
    time is the GPU's time between its edges, and nothing inside the window waits for the GPU."""

    def __init__(self, totals: dict[str, float]):
        self.totals = totals
        self.pending: list[tuple[str, Any, Any]] = []

    def start(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, name: str, started: Any) -> None:
        self.pending.append((name, started, self.start()))

    def settle(self) -> None:
        """Called with the device synchronised."""
        for name, started, ended in self.pending:
            self.totals[name] += started.elapsed_time(ended) / 1e3  # elapsed_time is in milliseconds
        self.pending.clear()


class _Timed:
    """A phase while the window is open: labelled in the trace and timed by the window's clock."""

    def __init__(self, name: str, clock: _WallClock | _StreamClock):
        self.name, self.clock = name, clock
        self.label: torch.autograd.profiler.record_function | None = None
        self.started: Any = None

    def __enter__(self) -> None:
        self.label = torch.autograd.profiler.record_function(f"runner/{self.name}")
        self.label.__enter__()
        self.started = self.clock.start()

    def __exit__(self, *exc) -> None:
        self.clock.stop(self.name, self.started)
        self.label.__exit__(*exc)


class WindowProfiler(AddOn):
    name = "profiler"

    def __init__(self, view: EngineView):
        spec, env, device = view.spec, view.env, view.device
        self.view, self.spec, self.env, self.device, self.tracker = view, spec, env, device, view.tracker
        self.asked_skip = spec.trainer.profile_skip_steps
        self.want = spec.trainer.profile_steps
        self.start_step, self.skip = 0, self.asked_skip  # set where the run starts (a resume: its step)
        self.run_setup = _setup(spec, env, device, view.optimizer)
        self.totals: dict[str, float] = defaultdict(float)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # at the window's edges only
        self.clock = _StreamClock(self.totals) if device.type == "cuda" else _WallClock(self.totals)
        self.live = Phases(lambda name: _Timed(name, self.clock))
        self.phase = OFF
        self.started = 0   # steps started by this process
        self.prof: torch.profiler.profile | None = None
        self.opened_at = 0.0
        self.figures: profile_advice.Figures | None = None
        self._trace: torch.profiler.profile | None = None  # the closed window's profiler, exported by finish()

    def steps(self, groups: Iterable) -> Iterator:
        """The engine's optimizer steps, the window opened and closed at step boundaries."""
        if self.started == 0:  # the run's first steps in this process: the window counts from here
            self.start_step = self.view.progress.step
            remaining = max(self.view.total_steps - self.start_step, 0)
            self.skip = min(self.asked_skip, max(remaining - self.want, 0))  # a short run is still profiled, at its end
            if self.skip < self.asked_skip and remaining and self.env.is_main:  # said as the run starts, not only in the report
                first, last = self.start_step + self.skip + 1, self.start_step + min(self.skip + self.want, remaining)
                asked = (f"trainer.profile_skip_steps={self.asked_skip} is past the {remaining} steps this run has left"
                         if self.asked_skip >= remaining else
                         f"trainer.profile_skip_steps={self.asked_skip} and trainer.profile_steps={self.want} do not "
                         f"both fit the {remaining} steps this run has left")
                log.warning("%s: profiling steps %d-%d, its last, instead; lower trainer.profile_skip_steps or train "
                            "longer to leave the warm-up out", asked, first, last)
        it = iter(groups)
        try:
            while True:
                # the profiler's own work (starting it takes seconds on a GPU, its events are processed at
                # the stop) and the profiled steps are not training time: throughput leaves them out
                if self.started == self.skip and self.prof is None and self.figures is None:
                    with self.view.untimed():
                        self._open()  # before the fetch: the first step's wait for data is in the window
                elif self.started == self.skip + self.want and self.prof is not None:
                    with self.view.untimed():
                        self._close()
                group = self._fetch(it)
                if group is _END:
                    return  # the epoch ended: an open window goes on into the next one
                self.started += 1
                yield group
        except BaseException:
            # the step loop broke off (its last step, early stopping) or failed: the window ends here
            if self.prof is not None:
                with self.view.untimed():
                    self._close()
            raise

    @property
    def profiling(self) -> bool:
        """Whether the step now running is in the window (its time is not throughput)."""
        return self.prof is not None

    def on_train_end(self, stop: Any) -> None:
        self.finish()

    def finish(self) -> None:
        """Training ended normally: report the window (rank 0) and write this rank's trace."""
        if self.prof is not None:
            self._close()
        if self.figures is None:
            if self.env.is_main:
                log.warning("trainer.profile: the run stopped after %d step(s), before the profiling window "
                            "(after %d skipped steps): nothing profiled; lower trainer.profile_skip_steps",
                            self.started, self.skip)
            return
        out = Path(self.spec.run_dir) / "profile"
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"profile_rank{self.env.rank}.pt.trace.json"
        self._trace.export_chrome_trace(str(trace))
        if not self.env.is_main:
            return
        text = profile_advice.report(self.figures, self.run_setup, self.start_step + self.skip, self.env.rank)
        if self.skip < self.asked_skip:
            text += (f"\n(skipped the first {self.skip} steps, not trainer.profile_skip_steps={self.asked_skip}: "
                     f"the run has too few steps)")
        if self.figures.steps < self.want:  # the window past the run's end: what was measured, said so
            text += (f"\n(profiled {self.figures.steps} steps, not trainer.profile_steps={self.want}: the run ended "
                     f"first)")
        text += f"\ntrace: {trace} (open it in https://ui.perfetto.dev or TensorBoard's profiler plugin)"
        log.info("%s", text)
        (out / "profile_report.txt").write_text(text + "\n")
        last_step = self.start_step + self.skip + self.figures.steps
        self.tracker.log_metrics({f"profile/{k}": v for k, v in self.figures.shares().items()}
                                 | {"profile/step_ms": self.figures.window_s / max(self.figures.steps, 1) * 1e3},
                                 last_step)
        self.tracker.log_artifact(out / "profile_report.txt")
        self.tracker.log_artifact(trace)

    def _fetch(self, it: Iterator):
        if self.prof is None:
            return next(it, _END)
        with self.view.untimed():  # a profiled step's wait for data: measured here, not throughput
            started = self.clock.start()
            with torch.autograd.profiler.record_function("runner/data"):
                group = next(it, _END)
            self.clock.stop("data", started)
        return group

    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:  # kineto's own lines on a CPU (USDT profiler_start/stop, "ERROR ... gpuGetDeviceCount failed"): noise
            # there, read when the profiler first starts; a KINETO_LOG_LEVEL the user set wins
            os.environ.setdefault("KINETO_LOG_LEVEL", "9")
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.start()
        self.sync()
        self.opened_at = time.perf_counter()
        self.phase = self.live

    def _close(self) -> None:
        self.sync()
        window_s = time.perf_counter() - self.opened_at
        self.clock.settle()
        self.phase = OFF
        prof, self.prof = self.prof, None
        prof.stop()
        events = prof.events()
        gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        on_gpu = self.device.type == "cuda"
        # on a GPU the collectives' kernels; gloo (CPU) runs them as host ops
        comm = [e for e in gpu if _COMMUNICATION.search(e.name)] or [e for e in events if _COMMUNICATION.search(e.name)]
        labels = [e for e in events if e.name.startswith("runner/")]  # the phases, as _Timed labels them
        self.figures = profile_advice.Figures(
            steps=self.started - self.skip, window_s=window_s, phase_s=dict(self.totals),
            communication_s=_overlap_s(comm, [e for e in labels if e.name != "runner/rank_sync"]),
            between_comm_s=_union_s(comm) - _overlap_s(comm, labels),
            # no device events at all means the trace missed them (CUPTI unavailable), not an idle GPU
            gpu_busy_s=_union_s(gpu) if on_gpu and gpu else None,
            h2d_copy_s=_union_s([e for e in gpu if "HtoD" in e.name]) if on_gpu and gpu else None)
        self._trace = prof


def build(view: EngineView) -> NoProfiler | WindowProfiler:
    if not view.spec.trainer.profile:
        return NoProfiler()
    return WindowProfiler(view)


def _spans(events: list) -> list[tuple[float, float]]:
    """The time the events cover, as disjoint sorted spans (overlapping ones, e.g. on several threads, merged)."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _union_s(events: list) -> float:
    return sum(b - a for a, b in _spans(events)) / 1e6  # the profiler's clock is in microseconds


def _overlap_s(events: list, others: list) -> float:
    """Seconds covered both by one of `events` and by one of `others`."""
    total, theirs = 0.0, _spans(others)
    for a, b in _spans(events):
        total += sum(max(0.0, min(b, d) - max(a, c)) for c, d in theirs)
    return total / 1e6


def _setup(spec: RunSpec, env: DistEnv, device: torch.device, optimizer: torch.optim.Optimizer) -> profile_advice.Setup:
    defaults = optimizer.defaults
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for_loop"
    cls = type(optimizer)
    offered = tuple(k for k in kernels(cls) if k != "fused" or fused_kernel_runs(cls, device.type))
    mode = spec.trainer.compile  # a bool, or a torch.compile mode
    mode = "off" if mode in (False, None, "false", "none") else "default" if mode is True else str(mode)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return profile_advice.Setup(
        device=device.type, bf16_supported=device.type == "cuda" and torch.cuda.is_bf16_supported(),
        precision=spec.precision.name, num_workers=spec.dataset.num_workers, cpus=cpus, compile=mode,
        parallelism=spec.parallelism.name, world=env.world, accumulation=spec.accumulation.steps,
        batch_size=spec.dataset.batch_size, optimizer_kernel=kernel, kernels_offered=offered,
        log_every=spec.trainer.log_every_n_steps)
