"""`make bench-pbt`: population-based training against random search with the same total steps.

The task: the digits MLP trained with SGD (momentum 0.9) at a constant learning rate for `--steps` optimizer
steps, objective val/loss. A large lr learns fastest early and a small one settles lowest late, so no
single constant lr is best throughout: that is what PBT's exploit/explore can follow and random search
cannot. Each sweep samples its 4 members' lr (and weight decay) from the same space with the same seed:
- random search: the 4 trained straight through (hydra.sweeper.ready = steps: one round, no exploit);
- PBT: rounds of `--ready` steps, the worst member copying the best's checkpoint and perturbing x0.8/x1.2;
- PB2: the same rounds, the GP bandit choosing the copier's hyperparameters.
All three run as the CLI runs them (python -m runner -m hparams_search=digits_pbt), tracking off so
MLflow's per-run cost does not blur the comparison. Printed: the best member's final val/loss and
val/acc, the wall time and the optimizer steps trained in all, side by side.

    python -m benchmarks.bench_pbt [--steps 240] [--ready 40] [--seeds 0 1] [override ...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPACE = ["optimizer=sgd", "optimizer.momentum=0.9", "scheduler=constant",
         "optimizer.lr=tag(log,interval(1e-3,0.5))", "optimizer.weight_decay=tag(log,interval(1e-6,1e-3))"]


def sweep(name: str, ready: int, explore: str, steps: int, seed: int, workdir: Path, overrides: list[str]) -> dict:
    sweep_dir = workdir / f"{name}-{seed}"
    cmd = [sys.executable, "-m", "runner", "-m", "hparams_search=digits_pbt", f"trainer.max_steps={steps}",
           f"hydra.sweeper.ready={ready}", f"hydra.sweeper.explore={explore}", f"hydra.sweeper.seed={seed}",
           "hydra.sweeper.population=4", "objective.metric=val/loss", "objective.direction=minimize",
           "trainer.device=cpu", "trainer.memory_estimate=false", "tracking=none", f"hydra.sweep.dir={sweep_dir}",
           *SPACE, *overrides]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"bench-pbt: the {name} sweep failed:\n{proc.stderr[-3000:]}")
    state = json.loads((sweep_dir / "pbt_state.json").read_text())
    best = min(state["members"], key=lambda m: m["objectives"][-1][1])
    acc = _final_acc(Path(best["run_dir"]))
    return {"loss": best["objectives"][-1][1], "acc": acc, "seconds": seconds, "steps": 4 * steps,
            "copies": sum(len(m["lineage"]) for m in state["members"])}


def _final_acc(run_dir: Path) -> float:
    from runner.engine import checkpoint

    history = checkpoint.read(run_dir)[1]["monitor"].get("history", {})  # the record alone: no tensor is read
    values = history.get("val/acc") or [(0, float("nan"))]
    return values[-1][1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--ready", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", default=["random", "pbt", "pb2"])
    args, overrides = parser.parse_known_args(argv)
    plan = {"random": (args.steps, "pbt"), "pbt": (args.ready, "pbt"), "pb2": (args.ready, "pb2")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for method in args.methods:
                ready, explore = plan[method]
                r = sweep(method, ready, explore, args.steps, seed, Path(tmp), overrides)
                rows.append((method, seed, r))
                print(f"  {method:6s} seed {seed}: best val/loss {r['loss']:.4f}  val/acc {r['acc']:.4f}  "
                      f"{r['seconds']:.1f} s", flush=True)
    print(f"\nbench-pbt: digits MLP, SGD (momentum 0.9) constant lr, 4 members x {args.steps} steps (rounds of {args.ready}), "
          f"seeds {args.seeds}")
    print(f"{'method':8s} {'best val/loss':>14s} {'val/acc':>8s} {'wall s':>8s} {'steps':>6s} {'copies':>6s}")
    for method in args.methods:
        mine = [r for m, _, r in rows if m == method]
        n = len(mine)
        print(f"{method:8s} {sum(r['loss'] for r in mine) / n:14.4f} {sum(r['acc'] for r in mine) / n:8.4f} "
              f"{sum(r['seconds'] for r in mine) / n:8.1f} {mine[0]['steps']:6d} {sum(r['copies'] for r in mine) / n:6.1f}")
    print("(means over the seeds; val/loss and val/acc of the best member at the last step)")


if __name__ == "__main__":
    main()
