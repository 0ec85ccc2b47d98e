"""`make bench-hpo`: what pruning buys on the digits study. Runs hparams_search=digits_optuna twice,
with the hyperband pruner and with none, and prints for each: epochs trained over all trials (each
trial reports once per epoch), wall time and the best value.

    python -m benchmarks.bench_hpo [--trials 20] [--jobs 1] [--pruners hyperband none] [override ...]

Each sweep is a fresh study in a temporary journal, run as the CLI runs it (python -m runner -m);
tracking is off so MLflow's per-run cost does not blur the comparison (pass tracking=mlflow to keep it).

    python -m benchmarks.bench_hpo --overhead [--repeat 3]

What the sweeper itself costs, on a task that costs nothing: the wall time of a 20-trial sweep of a
one-line objective (n_jobs=1 and 2), what is left after its last trial (the report), and the time
from the command's start to the end of the first trial with n_jobs=2; and for the digits study
(MLflow on, one epoch per trial) that time with n_jobs=2 next to n_jobs=1, whose jobs run in the
sweep process itself as hydra-optuna-sweeper's do.

    python -m benchmarks.bench_hpo --slots [--trials 20] [--repeat 3]

Two slots against one on short trials: a toy app's instant trials and 1-second trials, and the digits
study's one-epoch trials; the ratio of the two (ideal for 1-second trials: about 0.5).
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

from runner.search.trial import open_storage


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
  - override hydra/sweeper: runner_optuna
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


def timed_sweep(cmd: list[str], cwd: Path, sweep_dir: Path) -> tuple[float, float, list[float]]:
    """(wall seconds, CPU seconds, seconds from the start to each trial's end, sorted). CPU seconds
    count the sweep process and the processes it waited for (with n_jobs > 1 not its trials): less
    sensitive than wall time to other work on a shared machine."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    proc = subprocess.run([*cmd, f"hydra.sweep.dir={sweep_dir}"], cwd=cwd, capture_output=True, text=True)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"bench-hpo: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, [t - started for t in trial_ends(cwd, sweep_dir)]


def trial_ends(cwd: Path, sweep_dir: Path) -> list[float]:
    """When each trial of the sweep ended (wall-clock seconds). The study is in the sweep dir;
    sweepers from before `storage: null` meant a new study kept it in outputs/."""
    journal = sweep_dir / "optuna.journal"
    storage = open_storage(str(journal if journal.exists() else cwd / "outputs" / "optuna.journal"))
    return sorted(t.datetime_complete.timestamp() for name in optuna.get_all_study_names(storage)
                  for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
                  if t.datetime_complete is not None)


def overhead(repeat: int) -> None:
    rows: dict[str, list[float]] = {}

    def row(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory(prefix="bench-hpo-overhead-") as tmp:
        app = Path(tmp) / "toy"
        app.mkdir()
        (app / "app.py").write_text(TOY_APP)
        (app / "config.yaml").write_text(TOY_CONFIG)
        toy = [sys.executable, str(app / "app.py"), "-m"]
        digits = [sys.executable, "-m", "runner", "-m", "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2",
                  "hydra/sweeper/pruner=none", "trainer.max_epochs=1"]
        for i in range(repeat):
            run = Path(tmp) / f"run{i}"
            for name in ("toy1", "toy2", "digits2", "digits1"):
                (run / name).mkdir(parents=True)  # each sweep its own directory: outputs/ (MLflow, old journals) apart
            wall, cpu, ends = timed_sweep(toy, run / "toy1", run / "toy1" / "sweep")
            row("toy sweep, 20 trials, n_jobs=1: wall s", wall)
            row("toy sweep, 20 trials, n_jobs=1: CPU s", cpu)
            row("toy sweep, n_jobs=1: from its last trial's end to exit s", wall - ends[-1])
            wall, _, ends = timed_sweep([*toy, "hydra.sweeper.n_jobs=2"], run / "toy2", run / "toy2" / "sweep")
            row("toy sweep, 20 trials, n_jobs=2: wall s", wall)
            row("toy sweep, n_jobs=2: first trial done after s", ends[0])
            for jobs in (2, 1):
                _, _, ends = timed_sweep([*digits, f"hydra.sweeper.n_jobs={jobs}"], run / f"digits{jobs}",
                                         run / f"digits{jobs}" / "sweep")
                where = "a process per trial" if jobs > 1 else "trials in the sweep process"
                row(f"digits, 2 trials, n_jobs={jobs} ({where}): first done after s", ends[0])
                row(f"digits, 2 trials, n_jobs={jobs} ({where}): both done after s", ends[-1])
            print(f"bench-hpo: round {i + 1} of {repeat} done", flush=True)
    print()
    for name, values in rows.items():
        print(f"{name:<80}" + "".join(f"{v:8.1f}" for v in values) + f"   median {sorted(values)[len(values) // 2]:.1f}")


SLEEPY_APP = '''
import time
import hydra


@hydra.main(version_base=None, config_path=".", config_name="config")
def cost(cfg) -> float:
    time.sleep(cfg.sleep)
    return (cfg.width - 1.25) ** 2 + 0.5 * abs(cfg.layers - 3)


if __name__ == "__main__":
    cost()
'''


def slots(repeat: int, trials: int) -> None:
    """Two slots against one: a toy app whose trials return at once or sleep 1 s, and the digits
    study (one epoch a trial, MLflow on). Per row: seconds with 1 and 2 slots (the whole command, and
    from the first trial's start to the last one's end), and the ratio of 2 slots to 1."""
    rows: dict[str, dict[int, list[tuple[float, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-hpo-slots-") as tmp:
        app = Path(tmp) / "toy"
        app.mkdir()
        (app / "app.py").write_text(SLEEPY_APP)
        (app / "config.yaml").write_text(TOY_CONFIG.replace("layers: 1", "layers: 1\nsleep: 0.0"))
        cases = {f"toy app, {trials} instant trials": [sys.executable, str(app / "app.py"), "-m", "sleep=0"],
                 f"toy app, {trials} trials of 1 s": [sys.executable, str(app / "app.py"), "-m", "sleep=1"],
                 f"digits study, {trials} trials of 1 epoch": [
                     sys.executable, "-m", "runner", "-m", "hparams_search=digits_optuna", "hydra/sweeper/pruner=none",
                     "trainer.max_epochs=1"]}
        for i in range(repeat):
            for case, (name, cmd) in enumerate(cases.items()):
                for jobs in (1, 2):
                    run = Path(tmp) / f"round{i}-case{case}-jobs{jobs}"
                    run.mkdir(parents=True)
                    wall, _, _ = timed_sweep([*cmd, f"hydra.sweeper.n_trials={trials}", f"hydra.sweeper.n_jobs={jobs}"],
                                             run, run / "sweep")
                    rows.setdefault(name, {}).setdefault(jobs, []).append((wall, trial_span(run, run / "sweep")))
                print(f"bench-hpo: {name}, round {i + 1} of {repeat} done", flush=True)
    print(f"\n{'':<40}{'1 slot s':>10}{'2 slots s':>10}{'ratio':>7}   {'trials only: 1':>14}{'2':>6}{'ratio':>7}")
    for name, by_jobs in rows.items():
        median = {j: sorted(v)[len(v) // 2] for j, v in by_jobs.items()}
        (w1, s1), (w2, s2) = median[1], median[2]
        print(f"{name:<40}{w1:>10.1f}{w2:>10.1f}{w2 / w1:>7.2f}   {s1:>14.1f}{s2:>6.1f}{s2 / s1:>7.2f}")
    print("\n(medians over rounds; ratio: 2 slots / 1 slot; 'trials only' counts from the first trial's start to the "
          "last one's end)")


def trial_span(cwd: Path, sweep_dir: Path) -> float:
    journal = sweep_dir / "optuna.journal"
    storage = open_storage(str(journal if journal.exists() else cwd / "outputs" / "optuna.journal"))
    done = [t for name in optuna.get_all_study_names(storage)
            for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
            if t.datetime_complete is not None]
    return (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overhead", action="store_true", help="time the sweeper's own cost on a toy app instead")
    parser.add_argument("--slots", action="store_true", help="time 2 slots against 1 on short trials instead")
    parser.add_argument("--repeat", type=int, default=3, help="--overhead, --slots: rounds (the median is printed)")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="parallel trial slots of each sweep")
    parser.add_argument("--pruners", nargs="+", default=["hyperband", "none"])
    parser.add_argument("overrides", nargs="*", help="extra overrides for both sweeps, e.g. trainer.max_epochs=27")
    args = parser.parse_args()
    if args.overhead:
        overhead(args.repeat)
        return
    if args.slots:
        slots(args.repeat, args.trials)
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
