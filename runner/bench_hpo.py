"""`make bench-hpo`: what pruning buys on the digits study. Runs hparams_search=digits_optuna twice,
with the hyperband pruner and with none, and prints for each: epochs trained over all trials (each
trial reports once per epoch), wall time and the best value.

    python -m runner.bench_hpo [--trials 20] [--jobs 1] [--pruners hyperband none] [override ...]

Each sweep is a fresh study in a temporary journal, run as the CLI runs it (python -m runner -m);
tracking is off so MLflow's per-run cost does not blur the comparison (pass tracking=mlflow to keep it).

    python -m runner.bench_hpo --overhead [--repeat 3]

What the sweeper itself costs, on a task that costs nothing: the wall time of a 20-trial sweep of a
one-line objective (n_jobs=1), and the time from the command's start to its first trial's start
with n_jobs=2, for that toy app and for the digits study (MLflow on, one epoch per trial), the
latter next to n_jobs=1, whose jobs run in the sweep process itself as hydra-optuna-sweeper's do.
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


TOY_APP = '''
import hydra


@hydra.main(version_base=None, config_path=".", config_name="config")
def cost(cfg) -> float:
    return (cfg.width - 1.25) ** 2 + 0.5 * abs(cfg.layers - 3)


if __name__ == "__main__":
    cost()
'''
TOY_CONFIG = '''
defaults:
  - override hydra/sweeper: optuna
width: 0.0
layers: 1
hydra:
  sweeper:
    n_trials: 20
    sampler:
      seed: 11
    params:
      width: interval(0, 3)
      layers: choice(1, 2, 3, 4)
'''


def timed_sweep(cmd: list[str], cwd: Path, sweep_dir: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, seconds from the start to the first job's start). A job's start is
    when Hydra writes its .hydra/config.yaml, before the task function runs. CPU seconds count the
    sweep process and the processes it waited for (with n_jobs > 1 not its trials): less sensitive
    than wall time to other work on a shared machine."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    proc = subprocess.run([*cmd, f"hydra.sweep.dir={sweep_dir}"], cwd=cwd, capture_output=True, text=True)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"bench-hpo: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    first = min(p.stat().st_mtime for p in sweep_dir.glob("*/.hydra/config.yaml"))
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, first - started


def after_last_trial(cwd: Path, sweep_dir: Path, ended: float) -> float:
    """Seconds from the last trial's end to the sweep process's end: what the report costs. (The
    study is in the sweep dir; sweepers before `storage: null` meant that kept it in outputs/.)"""
    journal = sweep_dir / "optuna.journal"
    storage = open_storage(str(journal if journal.exists() else cwd / "outputs" / "optuna.journal"))
    done = [t.datetime_complete.timestamp() for name in optuna.get_all_study_names(storage)
            for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
            if t.datetime_complete is not None]
    return ended - max(done)


def overhead(repeat: int) -> None:
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-hpo-overhead-") as tmp:
        app = Path(tmp) / "toy"
        app.mkdir()
        (app / "app.py").write_text(TOY_APP)
        (app / "config.yaml").write_text(TOY_CONFIG)
        toy = [sys.executable, str(app / "app.py"), "-m"]
        digits = [sys.executable, "-m", "runner", "-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2",
                  "hydra.sweeper.n_jobs=2", "hydra/sweeper/pruner=none", "trainer.max_epochs=1"]
        for i in range(repeat):
            run = Path(tmp) / f"run{i}"
            run.mkdir()
            started = time.time()
            wall, cpu, _ = timed_sweep(toy, run, run / "toy1")
            rows.setdefault("toy sweep, 20 trials, n_jobs=1: wall s", []).append(wall)
            rows.setdefault("toy sweep, 20 trials, n_jobs=1: CPU s", []).append(cpu)
            rows.setdefault("toy sweep, n_jobs=1: after its last trial s", []).append(
                after_last_trial(run, run / "toy1", started + wall))
            wall, _, first = timed_sweep([*toy, "hydra.sweeper.n_jobs=2"], run, run / "toy2")
            rows.setdefault("toy sweep, 20 trials, n_jobs=2: wall s", []).append(wall)
            rows.setdefault("toy sweep, n_jobs=2: first trial after s", []).append(first)
            _, _, first = timed_sweep(digits, run, run / "digits2")
            rows.setdefault("digits study, n_jobs=2: first trial after s", []).append(first)
            (run / "in-process").mkdir()
            _, _, first = timed_sweep([*digits, "hydra.sweeper.n_jobs=1"], run / "in-process", run / "digits1")
            rows.setdefault("digits study, n_jobs=1 (in the sweep process): first trial after s", []).append(first)
            print(f"bench-hpo: round {i + 1} of {repeat} done", flush=True)
    print()
    for name, values in rows.items():
        print(f"{name:<70}" + "".join(f"{v:8.1f}" for v in values) + f"   median {sorted(values)[len(values) // 2]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overhead", action="store_true", help="time the sweeper's own cost on a toy app instead")
    parser.add_argument("--repeat", type=int, default=3, help="--overhead: rounds (the median is printed)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="parallel trial slots of each sweep")
    parser.add_argument("--pruners", nargs="+", default=["hyperband", "none"])
    parser.add_argument("overrides", nargs="*", help="extra overrides for both sweeps, e.g. trainer.max_epochs=27")
    args = parser.parse_args()
    if args.overhead:
        overhead(args.repeat)
        return
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
