"""`make bench-ranks`: each rank's peak memory under fsdp on 2 and 4 ranks, tp=2 and pp=2, beside one process's and
beside the ideal (the training state / ranks + a fixed cost), for GPT-2 124M and GPT-2 medium (355M).

Every case is a real run, as a user types it (`python -m runner ...`: build, 2 steps, evaluation, the final
checkpoint, the test), in its own processes:

    task=language_modeling model=gpt model.size=gpt2 dataset=synthetic_tokens dataset.block_size=64
    dataset.size=64 trainer.max_steps=2 tracking=none    + the case's parallelism, global batch 2

(fsdp on 4 ranks runs a batch of 1 per rank: a global batch of 4; its activations are small beside the state.)

- On a CPU, a rank's peak is its process's resident high-water mark (VmHWM in /proc/<pid>/status), sampled every
  0.1 s over the whole run and read once more as the process exits (benchmarks/peak_hook).
- On CUDA, torch.cuda.max_memory_allocated of each rank, written as the rank exits (the same hook).
- The fixed cost: the peak of the same case on the tiny gpt (2 x 128, a 64-token vocabulary: 6 MiB of state): what
  the interpreter, torch, the data and the process group hold whatever the model. Of it, torch's own share is
  printed first: the peak of a process that only imports torch and joins a gloo group (torch's CUDA build maps
  its CUDA libraries on a CPU too), and of one that also imports what FSDP2's hooks and DTensor import
  (torch._dynamo, sympy, triton: FSDP2 wraps each hook in torch._dynamo.disable).
- The training state: parameters x (4 parameter + 4 gradient + 8 AdamW) bytes; the ideal is that / ranks + the
  fixed cost. The issue's targets (34): each rank at most 0.65x one process under fsdp on 2 ranks, 0.45x on 4,
  0.7x under tp=2 and pp=2.

Figures are printed, never asserted. A 355M run needs about 6 GiB per process before the meta build: pick what
fits the machine with --models and --cases.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOOK = Path(__file__).resolve().parent / "peak_hook"
MiB = 2 ** 20

COMMON = ["task=language_modeling", "dataset=synthetic_tokens", "dataset.block_size=64", "dataset.size=64",
          "trainer.max_steps=2", "tracking=none"]
MODELS = {  # name: its overrides
    "gpt2": ["model=gpt", "model.size=gpt2"],
    "gpt2_medium": ["model=gpt2_medium"],
}
FIXED_COST_MODEL = ["model=gpt", "model.size=tiny", "dataset.vocab_size=64"]  # state: 0.4M parameters, 6 MiB
STATE_BYTES_PER_PARAMETER = 4 + 4 + 8  # fp32 parameter, its gradient, AdamW's two moments


@dataclass(frozen=True)
class Case:
    label: str
    overrides: tuple[str, ...]
    ranks: int
    target: float | None  # the bound on each rank's peak / one process's; None: the reference


CASES = {
    "single": Case("one process", ("dataset.batch_size=2",), 1, None),
    "fsdp2": Case("fsdp 2", ("dataset.batch_size=1", "parallelism=fsdp", "parallelism.nproc_per_node=2"), 2, 0.65),
    "fsdp4": Case("fsdp 4", ("dataset.batch_size=1", "parallelism=fsdp", "parallelism.nproc_per_node=4"), 4, 0.45),
    "tp2": Case("tp 2", ("dataset.batch_size=2", "parallelism.tp=2"), 2, 0.7),
    "pp2": Case("pp 2", ("dataset.batch_size=2", "parallelism.pp=2", "parallelism.pp_microbatches=2"), 2, 0.7),
}


@dataclass
class Peaks:
    """One run's peaks: bytes per rank (the launcher, where the run has one apart from its ranks, under -1)."""
    ranks: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    kind: str = "resident"  # or "cuda allocated"


TORCH_ALONE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
if os.environ.get("RUNNER_BENCH_FSDP_IMPORTS"):
    import torch._dynamo, torch.distributed.fsdp, torch.distributed.tensor, torch.distributed.checkpoint
dist.barrier()
dist.destroy_process_group()
"""


def torch_alone(fsdp_imports: bool) -> int:
    """The resident peak of a process that imports torch and joins a one-rank gloo group (and imports what FSDP2
    and DTensor import at their first use): torch's own part of every rank's fixed cost."""
    env = {**os.environ, "RUNNER_BENCH_FSDP_IMPORTS": "1" if fsdp_imports else ""}
    done = subprocess.run([sys.executable, "-c", TORCH_ALONE + "print(next(l for l in open('/proc/self/status') "
                           "if l.startswith('VmHWM')).split()[1])"], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) * 1024


def parameter_count(model_overrides: list[str]) -> int:
    """The model's parameters at the benchmark's data shape, counted on the meta device (nothing allocated)."""
    import inspect

    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import get_method

    from runner.specs.registry import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*COMMON, *model_overrides])
    build = get_method(cfg.model._target_)
    own = {k: v for k, v in cfg.model.items() if k in inspect.signature(build).parameters}  # not the engine's keys
    with torch.device("meta"):
        model = build(**own, vocab_size=cfg.dataset.vocab_size, max_length=cfg.dataset.block_size)
    return sum(p.numel() for p in model.parameters())  # a tied weight once


def training_state_bytes(parameters: int) -> int:
    return parameters * STATE_BYTES_PER_PARAMETER


def ideal_bytes(state: int, ranks: int, fixed: int) -> int:
    return state // ranks + fixed


def verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return ""
    return "met" if ratio <= target else "missed"


def _vmhwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
    return int(rank) if rank is not None else None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def measure(overrides: list[str], timeout: float = 1800) -> Peaks:
    """Runs `python -m runner <overrides>` in a temporary directory and returns each rank's peak."""
    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as where:
        peaks_dir = Path(where) / "peaks"
        peaks_dir.mkdir()
        path = os.pathsep.join([str(HOOK), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "PYTHONPATH": path, "RUNNER_BENCH_PEAKS": str(peaks_dir), "PYTHONUNBUFFERED": "1"}
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "runner", *overrides, "trainer.progress_bar=off"], cwd=where,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampled: dict[int, tuple[int | None, int]] = {}  # pid: (rank, highest VmHWM seen)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for pid in _descendants(proc.pid):
                    hwm = _vmhwm(pid)
                    if hwm is not None:
                        rank = sampled[pid][0] if pid in sampled else _rank_of(pid)
                        sampled[pid] = (rank, max(hwm, sampled.get(pid, (None, 0))[1]))
                done.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            output, _ = proc.communicate(timeout=timeout)
        finally:
            done.set()
            sampler.join()
            if proc.poll() is None:
                proc.kill()
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"the run failed (exit {proc.returncode}): python -m runner {' '.join(overrides)}\n"
                               + "\n".join(output.splitlines()[-15:]))
        written = {int(p.stem): json.loads(p.read_text()) for p in peaks_dir.glob("*.json")}
    return rank_peaks(proc.pid, sampled, written, seconds)


def rank_peaks(root: int, sampled: dict[int, tuple[int | None, int]], written: dict[int, dict],
               seconds: float) -> Peaks:
    """Each rank's peak from the sampled and the exit-time figures of the run's processes. A process with RANK
    in its environment is that rank; without any, the run's own process is rank 0; otherwise the launcher."""
    cuda = any("cuda_max_allocated" in r for r in written.values())
    peaks = Peaks(seconds=seconds, kind="cuda allocated" if cuda else "resident")
    by_pid: dict[int, tuple[int | None, int]] = {}
    for pid in {*sampled, *written}:
        rank, hwm = sampled.get(pid, (None, 0))
        record = written.get(pid, {})
        rank = int(record["rank"]) if record.get("rank") is not None else rank
        value = record.get("cuda_max_allocated", 0) if cuda else max(hwm, record.get("vmhwm", 0))
        by_pid[pid] = (rank, value)
    ranked = any(rank is not None for rank, _ in by_pid.values())
    for pid, (rank, value) in by_pid.items():
        if rank is None and pid != root:
            continue  # a helper process (a DataLoader worker, a compiler): not a rank
        key = rank if rank is not None else (-1 if ranked else 0)
        peaks.ranks[key] = max(value, peaks.ranks.get(key, 0))
    return peaks


def table(rows: list[dict]) -> str:
    header = (f"{'model':<12} {'case':<12} {'peak per rank (MiB)':<30} {'max':>7} {'vs one':>7} "
              f"{'ideal':>7} {'vs one':>7} {'target':>7}  verdict")
    lines = [header]
    for r in rows:
        per_rank = " ".join(f"{v / MiB:.0f}" for k, v in sorted(r["peaks"].items()) if k >= 0)
        target = f"<={r['target']:.2f}x" if r["target"] is not None else ""
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
        ideal = f"{r['ideal'] / MiB:.0f}" if r["ideal"] is not None else "n/a"
        ideal_ratio = f"{r['ideal_ratio']:.2f}x" if r["ideal_ratio"] is not None else "n/a"
        lines.append(f"{r['model']:<12} {r['case']:<12} {per_rank:<30} {r['max'] / MiB:>7.0f} {ratio:>7} "
                     f"{ideal:>7} {ideal_ratio:>7} {target:>7}  {r['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES)
                        + " (single, the reference, is always run)")
    parser.add_argument("--no-fixed-cost", action="store_true",
                        help="skip the tiny model's runs: no ideal column")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    cases = ["single", *(c for c in args.cases.split(",") if c and c != "single")]
    bad = [m for m in models if m not in MODELS] + [c for c in cases if c not in CASES]
    if bad:
        parser.error(f"unknown model or case: {', '.join(bad)}; models: {', '.join(MODELS)}; cases: {', '.join(CASES)}")

    fixed: dict[str, int] = {}
    if not args.no_fixed_cost:
        print(f"torch alone (import torch, a gloo group): {torch_alone(False) / MiB:.0f} MiB; with what FSDP2's hooks "
              f"and DTensor import (torch._dynamo, sympy, triton): {torch_alone(True) / MiB:.0f} MiB", flush=True)
        for key in cases:
            fixed[key] = max(measure([*COMMON, *FIXED_COST_MODEL, *CASES[key].overrides], args.timeout).ranks.values())
            print(f"fixed cost, {CASES[key].label}: {fixed[key] / MiB:.0f} MiB (the tiny gpt's peak)", flush=True)
    rows, kind = [], "resident"
    for model in models:
        params = parameter_count(MODELS[model])
        state = training_state_bytes(params)
        print(f"{model}: {params / 1e6:.1f}M parameters, training state {state / MiB:.0f} MiB "
              f"({STATE_BYTES_PER_PARAMETER} B per parameter)", flush=True)
        one = None
        for key in cases:
            case = CASES[key]
            peaks = measure([*COMMON, *MODELS[model], *case.overrides], args.timeout)
            kind = peaks.kind
            ranks = {k: v for k, v in peaks.ranks.items() if k >= 0}
            top = max(ranks.values())
            one = top if key == "single" else one
            ideal = ideal_bytes(state, case.ranks, fixed[key]) if key in fixed else None
            ratio = top / one if one else None
            rows.append(dict(model=model, case=case.label, peaks=ranks, max=top, ratio=ratio, ideal=ideal,
                             ideal_ratio=ideal / one if ideal is not None and one else None, target=case.target,
                             verdict=verdict(ratio, case.target) if ratio is not None else ""))
            launcher = f", launcher {peaks.ranks[-1] / MiB:.0f} MiB" if -1 in peaks.ranks else ""
            print(f"  {case.label}: {' '.join(f'{v / MiB:.0f}' for _, v in sorted(ranks.items()))} MiB per rank"
                  f"{launcher} ({peaks.seconds:.0f} s)", flush=True)
    how = ("peak CUDA memory allocated per rank (torch.cuda.max_memory_allocated)" if kind == "cuda allocated" else
           "peak resident memory per rank (VmHWM, sampled every 0.1 s and at exit)")
    print(f"\n{how}; ratios against one process's peak; ideal = training state / ranks + the fixed cost")
    print(table(rows))


if __name__ == "__main__":
    main()
