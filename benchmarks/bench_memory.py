"""`make bench-memory`: activation checkpointing on the built-in GPT, none / selective / full side by side.

For each mode: the activations one training step keeps from its forward pass for its backward pass (the
memory activation checkpointing saves), the step's peak memory on CUDA (torch.cuda.max_memory_allocated),
and the median step time (forward, backward, AdamW step). Rounds alternate the modes so machine noise
hits each alike. Every mode trains the same model from the same seed. Figures are printed, never asserted.

On CUDA: the GPT-2 small shape (124M parameters, 1024 tokens) in bf16 autocast. Without a GPU: a small
GPT on the CPU, where activations are glibc's count of bytes in use (runner/engine/memory_estimate.py) and a
step's time is the process's CPU time (all its threads), which other processes on a shared machine
disturb less than wall time; the output says which device it ran on.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from runner.engine import activation_checkpointing, memory_estimate
from runner.models.gpt import GPT

MODES = ("none", "selective", "full")
TARGET_ACTIVATIONS, TARGET_TIME = 0.5, 1.35  # the target: at least half the activations for at most 1.35x

SHAPES = {  # model arguments, batch, sequence length
    "cuda": (dict(vocab_size=50304, max_length=1024, size="gpt2"), 8, 1024),
    "cpu": (dict(vocab_size=512, max_length=256, n_layer=4, n_head=4, n_embd=128), 8, 256),
}


class Case:
    def __init__(self, mode: str, device: torch.device, model_args: dict, batch: int, length: int, compiled: bool):
        torch.manual_seed(0)
        self.mode, self.device = mode, device
        module = activation_checkpointing.apply(GPT(**model_args).to(device), mode)
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=device.type == "cuda")
        # compiled as the engine compiles (trainer.compile): the recomputation becomes part of the backward graph
        self.model = torch.compile(module) if compiled else module
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, model_args["vocab_size"], (batch, length + 1), generator=g).to(device)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.times: list[float] = []
        self.activations: list[int] = []
        self.peaks: list[int] = []

    def step(self, record: bool) -> None:
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                    else contextlib.nullcontext())
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before_step = memory_estimate.held_bytes(self.device)
        clock = time.perf_counter if cuda else time.process_time
        started = clock()
        with autocast:
            logits = self.model(self.inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.targets.flatten())
        del logits
        kept = memory_estimate.held_bytes(self.device) - before_step
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds = clock() - started
        if record:
            self.times.append(seconds)
            self.activations.append(kept)
            if cuda:
                self.peaks.append(torch.cuda.max_memory_allocated() - before_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each times every mode")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode per round")
    parser.add_argument("--compile", action="store_true", help="torch.compile each mode's model (trainer.compile=true)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if "none" not in modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: {args.modes!r}; give 'none' and any of {', '.join(MODES[1:])}, comma-separated")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    model_args, batch, length = SHAPES[device.type]
    cases = {mode: Case(mode, device, model_args, batch, length, args.compile) for mode in modes}
    for case in cases.values():
        case.step(record=False)  # warm-up: kernels chosen, workspaces and optimizer state allocated
        case.step(record=False)
    for _ in range(args.rounds):
        for case in cases.values():
            for _ in range(args.steps):
                case.step(record=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    params = sum(p.numel() for p in cases["none"].model.parameters())
    print(f"activation checkpointing on {where}: GPT {params / 1e6:.1f}M parameters, batch {batch} x {length} tokens"
          + (", bf16 autocast" if device.type == "cuda" else " (small shapes: no GPU here), fp32")
          + (", torch.compile" if args.compile else ", eager"))
    clock = "wall time" if device.type == "cuda" else "CPU time of this process"
    print(f"{args.rounds} rounds x {args.steps} steps per mode; medians; step time is {clock}")
    header = f"{'mode':<10} {'activations':>12} {'vs none':>8} {'step time':>10} {'vs none':>8}"
    print(header + (f" {'peak step memory':>17}" if device.type == "cuda" else ""))
    base_act = statistics.median(cases["none"].activations)
    base_time = statistics.median(cases["none"].times)
    for mode, case in cases.items():
        act, secs = statistics.median(case.activations), statistics.median(case.times)
        row = (f"{mode:<10} {act / 2**20:>9.1f} MiB {act / base_act:>8.2f} {secs * 1e3:>7.1f} ms "
               f"{secs / base_time:>7.2f}x")
        if device.type == "cuda":
            row += f" {statistics.median(case.peaks) / 2**30:>13.2f} GiB"
        if mode != "none":
            met = act / base_act <= TARGET_ACTIVATIONS and secs / base_time <= TARGET_TIME
            row += "   target met" if met else "   target missed"
        print(row)
    print(f"target: at most {TARGET_ACTIVATIONS:.0%} of the activations for at most {TARGET_TIME}x the step time")


if __name__ == "__main__":
    main()
