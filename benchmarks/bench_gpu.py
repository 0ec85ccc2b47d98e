"""`make bench-gpu`: what the engine gets out of one GPU on the two workloads the presets are about.

1. GPT-2 124M shape (12 layers, 12 heads, width 768, context 1024, vocab 50304), bf16, torch.compile,
   fused AdamW, SDPA attention (models/gpt.py), on random tokens already on the GPU: tokens/s and MFU.
2. ResNet-18 on the CIFAR-10 shape, batch 512, bf16, channels_last, torch.compile, data on the GPU:
   samples/s and seconds per 50k-sample epoch, the engine beside a minimal hand-written loop, their
   blocks of steps alternating in one run (benchmarks/bench_workloads.py).

Where no GPU is available the same benchmarks run on the CPU with small shapes, fp32 and no compile,
and say so: those figures are not the GPU targets. Numbers are printed, never asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_workloads import interleaved, workload_spec
from runner.engine.flops import device_peak
from runner.engine.parallel import pick_device

EPOCH = 50_000  # CIFAR-10's training samples


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, context: int) -> float:
    """Training FLOPs per token of a decoder transformer: 6N for the matmuls with the weights (forward 2N,
    backward 4N; N without the position embedding, which is a lookup) plus 12·L·H·Q·T for attention's
    two matmuls per layer (PaLM, appendix B; nanoGPT and torchtitan count the same). The bench prints the
    MFU of this formula beside the engine's own, which runner/engine/flops.py counts with torch's FLOP counter."""
    return 6 * n_params + 12 * n_layer * n_head * head_dim * context


def gpt_params(model: torch.nn.Module) -> int:
    """models/gpt.py's GPT parameters, counted once (the lm head shares the token embedding's), the position
    embedding (a lookup, no matmul) left out."""
    return sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()


def gpt_flops_per_token(model: torch.nn.Module, context: int) -> float:
    """flops_per_token for models/gpt.py's GPT."""
    return flops_per_token(gpt_params(model), model.n_layer, model.n_head, model.n_embd // model.n_head, context)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """One device's dense peak FLOP/s at this precision, from runner/engine/flops.py's table of known GPUs."""
    peak = device_peak(None, precision, device)
    return peak * 1e12 if peak else None


def gpt_overrides(gpu: bool, batch: int | None) -> list[str]:
    common = ["task=language_modeling", "dataset=synthetic_tokens", "model=gpt", "model.dropout=0.0",
              "optimizer=adamw", "optimizer.lr=6e-4", "optimizer.betas=[0.9,0.95]", "optimizer.weight_decay=0.1",
              "trainer.clip_grad_norm=1.0", "objective.metric=val/loss", "objective.direction=minimize"]
    if gpu:
        return [*common, "model.size=gpt2", "dataset.vocab_size=50304", "dataset.block_size=1024", "dataset.size=1024",
                f"dataset.batch_size={batch or 16}", "precision=bf16", "trainer.compile=true", "optimizer.impl=fused"]
    return [*common, "model.size=tiny", "dataset.vocab_size=4096", "dataset.block_size=128", "dataset.size=256",
            f"dataset.batch_size={batch or 8}", "precision=fp32"]


def resnet_overrides(gpu: bool, batch: int | None) -> list[str]:
    common = ["experiment=cifar10_resnet", "dataset=synthetic", "dataset.shape=[3,32,32]", "dataset.num_classes=10",
              "dataset.num_workers=0", "trainer.channels_last=true"]
    if gpu:  # 20k samples (14k train): the data sits on the GPU, gathered per batch there
        return [*common, "dataset.size=20000", f"dataset.batch_size={batch or 512}", "precision=bf16", "trainer.compile=true"]
    return [*common, "dataset.size=512", f"dataset.batch_size={batch or 16}", "precision=fp32"]


def timed_window(spec, warmup: int, end: int | None = None) -> tuple[float, int, object]:
    """Seconds of the engine's steps after `warmup` up to step `end` (default: the last), the steps timed,
    and the engine. The GPU is synchronized only at the window's two ends, so the engine runs as in any
    run; steps after `end` (a profiled window) are not timed."""
    from runner.engine.engine import Engine
    from runner.tracking.tracker import build_tracker

    engine = Engine(spec, build_tracker(spec))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    marks: dict[int, float] = {}
    on_step = engine.monitor.on_step
    end = end or engine.total_steps

    def stamped(step: int, *args, **kwargs) -> None:
        on_step(step, *args, **kwargs)
        if step in (warmup, end):
            sync()
            marks[step] = time.perf_counter()

    engine.monitor.on_step = stamped
    engine.fit()
    return marks[end] - marks[warmup], end - warmup, engine


def bench_gpt(gpu: bool, steps: int, warmup: int, batch: int | None, workdir: Path, profile: int = 0,
              label: str = "engine") -> float:
    """The engine on the GPT workload: prints tokens/s and MFU, returns the MFU (0 where no peak is known).
    `profile` > 0: that many steps more after the timed window, under trainer.profile (its report printed)."""
    overrides = gpt_overrides(gpu, batch)
    if profile:
        overrides += ["trainer.profile=true", f"trainer.profile_skip_steps={warmup + steps}", f"trainer.profile_steps={profile}"]
    spec = workload_spec(overrides, warmup + steps + (profile + 1 if profile else 0), workdir)
    seconds, timed, engine = timed_window(spec, warmup, warmup + steps)
    model, data = engine.module, engine.spec.dataset
    tokens_per_s = timed * data.batch_size * data.get("block_size") / seconds
    n_params = gpt_params(model)
    flops = gpt_flops_per_token(model, data.get("block_size"))
    tflops, peak = tokens_per_s * flops / 1e12, peak_flops(engine.device, engine.spec.precision.name)
    mfu = tokens_per_s * flops / peak if peak else 0.0
    logged = engine.monitor.history.get("throughput/mfu")  # the engine's own figure, where runner/engine/flops.py logs it
    print(f"GPT ({label}): {model.n_layer} layers, {model.n_head} heads, width {model.n_embd}, context {data.get('block_size')}, "
          f"vocab {data.get('vocab_size')}, {n_params / 1e6:.1f}M parameters (without wpe); batch {data.batch_size}, "
          f"{engine.spec.precision.name}, compile {'on' if engine.spec.trainer.compile else 'off'}, "
          f"AdamW {engine.spec.optimizer.impl}, SDPA, loss {'compiled' if engine.compiled_task is not None else 'eager'}")
    print(f"  {timed} steps after {warmup} warm-up: {tokens_per_s:,.0f} tokens/s, {seconds / timed * 1e3:.1f} ms/step, "
          f"{tflops:.3g} TFLOP/s, MFU {f'{mfu:.1%}' if peak else 'n/a (no peak FLOP/s known for this device)'} "
          "(6N + attention)" + (f", engine-logged MFU {logged[-1][1]:.1%} (FLOP counter)" if logged else "")
          + "   target: 50% MFU", flush=True)
    return mfu


def bench_gpt_hand(gpu: bool, steps: int, warmup: int, batch: int | None, workdir: Path) -> float:
    """A minimal hand loop on the GPT workload with every batch already on the device: the same model,
    fused AdamW with the same groups, bf16 autocast and clipping, one compiled function for forward and
    loss. What the engine's data path, checks and logging cost is the gap to bench_gpt."""
    import torch.nn.functional as F
    from runner.engine.optim import build_optimizer
    from runner.engine.rng import seed_everything
    from runner.engine import components
    from runner.engine.run_data import build_data
    from runner.tasks import IGNORE

    spec = workload_spec(gpt_overrides(gpu, batch), warmup + steps, workdir)
    seed_everything(spec.seed, False)
    device = pick_device(spec.trainer.device)
    data = build_data(spec)
    model = components.build_model(spec, data).to(device)
    optimizer = build_optimizer(spec.optimizer, model, device)
    size, length, vocab = spec.dataset.batch_size, spec.dataset.get("block_size"), spec.dataset.get("vocab_size")
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, vocab, (8 * size, length + 1), device=device, generator=g)
    dtype = torch.bfloat16 if spec.precision.name == "bf16" else None

    def forward_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(inputs)
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE)

    step_fn = torch.compile(forward_loss) if spec.trainer.compile else forward_loss
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            sync()
            started = time.perf_counter()
        chunk = tokens[(step % 8) * size:(step % 8 + 1) * size]
        loss = step_fn(chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    seconds = time.perf_counter() - started
    tokens_per_s = steps * size * length / seconds
    flops = gpt_flops_per_token(model, length)
    peak = peak_flops(device, spec.precision.name)
    mfu = tokens_per_s * flops / peak if peak else 0.0
    print(f"GPT (hand loop, tokens on the {device.type}, forward+loss compiled as one): {steps} steps after {warmup} "
          f"warm-up: {tokens_per_s:,.0f} tokens/s, {seconds / steps * 1e3:.1f} ms/step, "
          f"MFU {f'{mfu:.1%}' if peak else 'n/a'}", flush=True)
    return mfu


def bench_resnet(gpu: bool, steps: int, warmup: int, batch: int | None, block: int, workdir: Path) -> None:
    spec = workload_spec(resnet_overrides(gpu, batch), warmup + steps, workdir)
    engine_s, hand_s, engine = interleaved(spec, block=block)
    skip = max(warmup // block, 1)  # the first blocks hold compilation
    e, h = statistics.median(engine_s[skip:]), statistics.median(hand_s[skip:])
    ts, batch = engine.spec.trainer, engine.spec.dataset.batch_size
    print(f"\nResNet-18, CIFAR-10 shape: batch {batch}, {engine.spec.precision.name}, "
          f"channels_last {'on' if ts.channels_last else 'off'}, compile {'on' if ts.compile else 'off'}, data on "
          f"{engine.device.type}; median of blocks of {block} step(s), engine and hand loop alternating")
    print(f"  {'':<8} {'samples/s':>10} {'s/epoch (50k)':>14} {'ms/step':>8}")
    for name, seconds in (("engine", e), ("hand", h)):
        print(f"  {name:<8} {batch / seconds:>10,.0f} {EPOCH / (batch / seconds):>14.1f} {seconds * 1e3:>8.2f}")
    print(f"  engine/hand step time: {e / h:.3f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 30 on a GPU, 6 on a CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (compilation; default 10 / 2)")
    parser.add_argument("--gpt-batch", type=int, default=None, help="GPT micro-batch (default: 16 on a GPU)")
    parser.add_argument("--resnet-batch", type=int, default=None, help="ResNet batch (default: 512 on a GPU)")
    parser.add_argument("--only", choices=("gpt", "resnet"), default=None)
    parser.add_argument("--hand", action="store_true", help="GPT: also a hand loop with the tokens on the device")
    parser.add_argument("--eager-loss", action="store_true", help="GPT: also the engine with its loss left eager")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs (profile traces) here instead of a temporary folder")
    parser.add_argument("--profile", type=int, default=0, help="GPT: profile this many steps after the timed window")
    args = parser.parse_args(argv)
    gpu = pick_device("auto").type == "cuda"
    if args.profile:  # the profiler's report is logged at info: printed here
        profiling_log = logging.getLogger("runner.addons.profiling")
        profiling_log.setLevel(logging.INFO)
        profiling_log.addHandler(logging.StreamHandler(sys.stdout))
    steps = args.steps or (30 if gpu else 6)
    warmup = max(args.warmup if args.warmup is not None else (10 if gpu else 2), 1)  # the window starts after a step
    print(f"device: {torch.cuda.get_device_name()}" if gpu else
          "device: cpu (no GPU): small shapes, fp32, no compile; not the GPU targets")
    with (contextlib.nullcontext(str(args.workdir)) if args.workdir else tempfile.TemporaryDirectory()) as tmp:
        if args.only in (None, "gpt"):
            engine_mfu = bench_gpt(gpu, steps, warmup, args.gpt_batch, Path(tmp) / "gpt", profile=args.profile)
            if args.eager_loss:
                from runner.engine import compiling
                compiling.COMPILE_LOSS = False
                bench_gpt(gpu, steps, warmup, args.gpt_batch, Path(tmp) / "gpt-eager-loss", label="engine, loss eager")
                compiling.COMPILE_LOSS = True
            if args.hand:
                hand_mfu = bench_gpt_hand(gpu, steps, warmup, args.gpt_batch, Path(tmp) / "gpt-hand")
                if hand_mfu:
                    print(f"  engine/hand MFU: {engine_mfu / hand_mfu:.3f}", flush=True)
        if args.only in (None, "resnet"):
            bench_resnet(gpu, steps, warmup, args.resnet_batch, 5 if gpu else 1, Path(tmp) / "resnet")


if __name__ == "__main__":
    main()
