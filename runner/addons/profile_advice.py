"""What a profiled window of training steps says, in plain words: where the step time went and what to
change. A pure function of the measured figures (runner/addons/profiling.py measures them), so each piece of
advice can be tested on given numbers.

Every line of advice quotes the figure it comes from and appears only when that figure crosses its
threshold below; nothing is advised from the configuration alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Thresholds, as fractions of the window's step time (GPU_IDLE: of the window's wall time). Chosen so
# that a line of advice names something that costs a real part of each step, not measurement noise.
DATA_SHARE = 0.15         # waiting for the next batch
COMPUTE_SHARE = 0.30      # forward + backward: only then does lower precision pay off
GPU_IDLE = 0.25           # no kernel running on the GPU (launch overhead, syncs, Python between kernels)
OPTIMIZER_SHARE = 0.15    # clipping, the optimizer's update, zeroing gradients
COMMUNICATION_SHARE = 0.15  # collectives (all-reduce, reduce-scatter, all-gather) under ddp/fsdp
TO_DEVICE_SHARE = 0.10    # moving the batch to the device (and the batch transforms, e.g. mixup)
RANK_WAIT_SHARE = 0.15    # the step's first all-reduce (its sample count): the time a rank waits for the slowest
OTHER_SHARE = 0.25        # outside the phases: logging, evaluation, checkpoints, Python in the loop

PHASES = ("data", "rank_sync", "to_device", "forward", "backward", "optimizer")
LABELS = {"data": "waiting for data", "rank_sync": "waiting for ranks", "to_device": "batch to device",
          "forward": "forward", "backward": "backward", "optimizer": "optimizer step",
          "other": "other"}


@dataclass(frozen=True)
class Figures:
    """What one rank measured over the profiled window."""

    steps: int                      # optimizer steps in the window
    window_s: float                 # their wall time together
    phase_s: dict[str, float]       # PHASES -> seconds over the window: wall time; on CUDA the stream's time between the edges
    # collectives in the trace: those inside forward/backward/optimizer (the gradients' all-reduce, FSDP's
    # gathers; they overlap those phases), and those outside every phase (the ranks' per-step vote; in "other")
    communication_s: float = 0.0
    between_comm_s: float = 0.0
    gpu_busy_s: float | None = None  # kernels and copies running on the GPU (their union); None: no GPU
    h2d_copy_s: float | None = None  # host-to-device copies on the GPU; None: no GPU

    def share(self, phase: str) -> float:
        if phase == "other":
            return max(0.0, 1.0 - sum(self.share(p) for p in PHASES))
        return self.phase_s.get(phase, 0.0) / self.window_s if self.window_s > 0 else 0.0

    @property
    def communication_share(self) -> float:
        return self.communication_s / self.window_s if self.window_s > 0 else 0.0

    @property
    def gpu_idle(self) -> float | None:
        if self.gpu_busy_s is None or self.window_s <= 0:
            return None
        return max(0.0, 1.0 - self.gpu_busy_s / self.window_s)

    @property
    def between_comm_share(self) -> float:
        return min(self.between_comm_s / self.window_s, self.share("other")) if self.window_s > 0 else 0.0

    def shares(self) -> dict[str, float]:
        """The figures logged to MLflow (fractions of step time; gpu_idle of the window)."""
        out = {p: self.share(p) for p in (*PHASES, "other")}
        out["communication"] = self.communication_share
        if self.gpu_idle is not None:
            out["gpu_idle"] = self.gpu_idle
        if self.h2d_copy_s is not None:
            out["h2d_copy"] = self.h2d_copy_s / self.window_s if self.window_s > 0 else 0.0
        return out


@dataclass(frozen=True)
class Setup:
    """The run's settings the advice refers to (what to change, and from what)."""

    device: str = "cpu"              # cpu | cuda
    bf16_supported: bool = False     # the GPU runs bf16 (CUDA only)
    precision: str = "fp32"
    num_workers: int = 0
    cpus: int = 1                    # CPUs this process may use
    compile: str = "off"             # off, or the torch.compile mode
    parallelism: str = "single"
    world: int = 1
    accumulation: int = 1
    batch_size: int = 1
    optimizer_kernel: str = "for_loop"   # fused | foreach | for_loop: what the optimizer runs
    kernels_offered: tuple[str, ...] = field(default=("for_loop",))  # what optimizer.impl may choose here
    log_every: int = 10


def advise(fig: Figures, setup: Setup) -> list[str]:
    """One line per change the figures call for, the most costly first."""
    lines: list[tuple[float, str]] = []

    def say(figure: float, text: str) -> None:
        lines.append((figure, text))

    data = fig.share("data")
    if data >= DATA_SHARE:
        fix = (f"raise dataset.num_workers (now {setup.num_workers}; this machine has {setup.cpus} CPUs)"
               if setup.num_workers < setup.cpus else
               f"make the dataset's __getitem__ cheaper (dataset.num_workers is {setup.num_workers} already, "
               f"as many as the {setup.cpus} CPUs)")
        say(data, f"data loading is {_pct(data)} of step time: {fix}")

    compute = fig.share("forward") + fig.share("backward")
    if (setup.device == "cuda" and setup.bf16_supported and setup.precision in ("fp32", "tf32")
            and compute >= COMPUTE_SHARE):
        say(compute, f"forward and backward are {_pct(compute)} of step time in {setup.precision}, on a GPU that "
                     f"supports bf16: try precision=bf16 (mixed precision)")

    idle = fig.gpu_idle
    if idle is not None and idle >= GPU_IDLE:
        if setup.compile != "reduce-overhead":
            fix = (f"try trainer.compile=reduce-overhead (CUDA graphs launch the step's kernels at once; "
                   f"now {setup.compile})")
        else:
            fix = f"raise dataset.batch_size (now {setup.batch_size}) so each kernel does more work"
        if data >= DATA_SHARE:
            fix += "; part of it is the wait for data above"
        say(idle, f"the GPU is idle between kernels {_pct(idle)} of the window: {fix}")

    optimizer = fig.share("optimizer")
    if optimizer >= OPTIMIZER_SHARE:
        # fused is the fast path on CUDA only (runner/engine/optim.py picks foreach on a CPU)
        faster = [k for k in ("fused", "foreach")
                  if k in setup.kernels_offered and (k != "fused" or setup.device == "cuda")]
        faster = faster[:faster.index(setup.optimizer_kernel)] if setup.optimizer_kernel in faster else faster
        if faster:
            fix = f"try optimizer.impl={faster[0]} (now {setup.optimizer_kernel})"
        else:
            fix = (f"it runs the {setup.optimizer_kernel} kernel already; raise accumulation.steps (now "
                   f"{setup.accumulation}) or dataset.batch_size (now {setup.batch_size}) so it runs less often "
                   f"per sample")
        say(optimizer, f"the optimizer step is {_pct(optimizer)} of step time: {fix}")

    comm = fig.communication_share
    if setup.world > 1 and comm >= COMMUNICATION_SHARE:
        if setup.parallelism in ("fsdp", "hsdp"):  # parameters are gathered for every micro-step, whatever the accumulation
            fix = (f"raise dataset.batch_size (now {setup.batch_size}) so each gather serves more samples, or use "
                   f"parallelism=ddp if the model and its optimizer state fit on one device")
        else:
            fix = (f"raise accumulation.steps (now {setup.accumulation}; gradients are synchronised once per "
                   f"optimizer step) or dataset.batch_size (now {setup.batch_size}) so each synchronisation serves "
                   f"more samples")
        say(comm, f"communication ({setup.parallelism}, {setup.world} ranks) is {_pct(comm)} of step time: {fix}")

    waiting = fig.share("rank_sync") + fig.between_comm_share
    if setup.world > 1 and waiting >= RANK_WAIT_SHARE:
        say(waiting, f"the step's small collectives outside backward (its sample count, the ranks' stop vote) take "
                     f"{_pct(waiting)} of step time: mostly ranks waiting for a slower one (uneven data loading, "
                     f"another job on its device or CPUs); compare the ranks' traces in <run_dir>/profile")

    to_device = fig.share("to_device")
    if to_device >= TO_DEVICE_SHARE:
        say(to_device, f"moving batches to the device (and batch transforms) is {_pct(to_device)} of step time: keep "
                       f"samples small on the host (e.g. uint8 images, normalised on the device) or the dataset on "
                       f"the device (small tensor datasets are put there automatically)")

    other = fig.share("other") - fig.between_comm_share  # those collectives are advised on above
    if other >= OTHER_SHARE:
        say(other, f"{_pct(other)} of step time is spent between the phases (logging every {setup.log_every} steps, "
                   f"evaluation, checkpoints, collectives between steps, Python in the loop; the trace shows which): "
                   f"log or evaluate less often, or try trainer.compile where it is Python overhead")
    return [text for _, text in sorted(lines, key=lambda item: -item[0])]


def report(fig: Figures, setup: Setup, first_step: int, rank: int = 0) -> str:
    """The plain-language report: the step-time breakdown, then the advice."""
    per_step = fig.window_s / max(fig.steps, 1)
    lines = [f"profile of {fig.steps} optimizer step(s) (steps {first_step + 1}-{first_step + fig.steps}, rank {rank}, "
             f"{setup.device}): {per_step * 1e3:.2f} ms per step"]
    for phase in PHASES:
        if phase == "rank_sync" and setup.world == 1:
            continue  # one process waits for no one
        lines.append(f"  {LABELS[phase]:<17} {_pct(fig.share(phase)):>6}")
    lines.append(f"  {'other':<17} {_pct(fig.share('other')):>6}  (between the phases: logging, evaluation, "
                 f"checkpoints, Python)")
    if fig.between_comm_s:
        lines.append(f"    {'collectives':<15} {_pct(fig.between_comm_share):>6}  (of other: the ranks' per-step vote, "
                     f"any collective between the phases)")
    if setup.world > 1 or fig.communication_s:
        lines.append(f"  {'communication':<17} {_pct(fig.communication_share):>6}  (collectives inside the phases, "
                     f"e.g. the gradients' all-reduce; they overlap backward)")
    if fig.h2d_copy_s is not None:
        lines.append(f"  {'host-to-device':<17} {_pct(fig.h2d_copy_s / fig.window_s if fig.window_s else 0):>6}  "
                     f"(copies on the GPU, in the trace)")
    if fig.gpu_idle is not None:
        lines.append(f"  {'GPU idle':<17} {_pct(fig.gpu_idle):>6}  (of the window, no kernel running)")
    advice = advise(fig, setup)
    if advice:
        lines.append("advice:")
        lines.extend(f"  - {text}" for text in advice)
    else:
        lines.append("advice: none; no figure crossed its threshold (runner/addons/profile_advice.py)")
    return "\n".join(lines)


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"
