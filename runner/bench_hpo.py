"""`make bench-hpo`: what pruning buys on the digits study. Runs hparams_search=digits_optuna twice,
with the hyperband pruner and with none, and prints for each: epochs trained over all trials (each
trial reports once per epoch), wall time and the best value.

    python -m runner.bench_hpo [--trials 20] [--jobs 1] [--pruners hyperband none] [override ...]

Each sweep is a fresh study in a temporary journal, run as the CLI runs it (python -m runner -m);
tracking is off so MLflow's per-run cost does not blur the comparison (pass tracking=mlflow to keep it).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from runner.trial import open_storage


def sweep(pruner: str, trials: int, jobs: int, workdir: Path, overrides: list[str]) -> dict:
    storage = workdir / "bench.journal"
    study_name = f"bench-{pruner}"
    cmd = [sys.executable, "-m", "runner", "-m", "hparams_search=digits_optuna", f"hydra/sweeper/pruner={pruner}",
           f"hydra.sweeper.n_trials={trials}", f"hydra.sweeper.n_jobs={jobs}", f"hydra.sweeper.storage={storage}",
           f"hydra.sweeper.study_name={study_name}", f"hydra.sweep.dir={workdir / study_name}",
           "tracking=none", *overrides]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"bench-hpo: the {pruner} sweep failed:\n{proc.stderr[-3000:]}")
    study = optuna.load_study(study_name=study_name, storage=open_storage(str(storage)))
    done = study.get_trials(deepcopy=False)
    return {"pruner": pruner, "epochs": sum(len(t.intermediate_values) for t in done), "seconds": seconds,
            "best": study.best_value, "pruned": sum(t.state == TrialState.PRUNED for t in done), "trials": len(done)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="parallel trial slots of each sweep")
    parser.add_argument("--pruners", nargs="+", default=["hyperband", "none"])
    parser.add_argument("overrides", nargs="*", help="extra overrides for both sweeps, e.g. trainer.max_epochs=27")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-hpo-") as tmp:
        rows = []
        for pruner in args.pruners:
            print(f"bench-hpo: digits study, {args.trials} trials, pruner {pruner} ...", flush=True)
            rows.append(sweep(pruner, args.trials, args.jobs, Path(tmp), args.overrides))
    print(f"\n{'pruner':<12}{'trials':>7}{'pruned':>8}{'epochs':>8}{'wall s':>9}{'best val/acc':>14}")
    for r in rows:
        print(f"{r['pruner']:<12}{r['trials']:>7}{r['pruned']:>8}{r['epochs']:>8}{r['seconds']:>9.1f}{r['best']:>14.4f}")
    if len(rows) == 2 and rows[0]["epochs"]:
        a, b = rows
        print(f"\n{a['pruner']} vs {b['pruner']}: {b['epochs'] / a['epochs']:.2f}x fewer epochs, "
              f"{b['seconds'] / a['seconds']:.2f}x less wall time, best value {100 * (a['best'] - b['best']):+.2f} points")


if __name__ == "__main__":
    main()
