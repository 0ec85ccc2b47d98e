"""Start-up of `python -m runner` as a user meets it, each time beside its target (`make bench`; never
asserted: it depends on the machine and what else runs on it).

Every figure is wall time from starting the process: to its exit for `--cfg job` and a typo, to the
first training line (the first `epoch ...` line; the run is then interrupted) for the default run, whose
MLflow store is a fresh one for the first run and an existing one for the rest.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAINING_LINE = "epoch "
CASES = (  # what, arguments, the line that ends the measurement (None: the process's exit), target in s
    ("--cfg job", ["--cfg", "job"], None, 1.5),
    ("a typo: optimizer.lrr=1", ["optimizer.lrr=1"], None, 1.0),
    ("default run: first training line", [], TRAINING_LINE, 4.0),
)


def seconds_to(args: list[str], until: str | None, cwd: Path) -> float:
    """Seconds from starting `python -m runner <args>` in cwd to its exit, or to its first line starting with until."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if until is not None and line.startswith(until):
            seconds = time.perf_counter() - started
            proc.send_signal(signal.SIGINT)  # enough measured: the run ends KILLED, as on Ctrl-C
            proc.communicate()
            return seconds
    proc.wait()
    if until is not None:
        raise RuntimeError(f"`python -m runner {' '.join(args)}` printed no line starting with {until!r}: "
                           f"{''.join(seen[-3:]).strip()}")
    return time.perf_counter() - started


def bench_startup(runs: int) -> None:
    """Prints the median of `runs` measurements of each case beside its target."""
    print(f"{'start-up (python -m runner ...)':<44} {'median s':>9} {'target s':>9}  verdict  (each run, s)")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        fresh = seconds_to([], TRAINING_LINE, cwd)  # creates and migrates outputs/mlflow.db
        for what, args, until, target in CASES:
            times = [seconds_to(args, until, cwd) for _ in range(runs)]
            median = statistics.median(times)
            print(f"{what:<44} {median:>9.2f} {target:>9.1f}  {'ok' if median <= target else 'over':<7}  "
                  f"({' '.join(f'{t:.2f}' for t in times)})", flush=True)
        print(f"{'default run, fresh MLflow store: first line':<44} {fresh:>9.2f} {'':>9}  {'':<7}  (once)")
