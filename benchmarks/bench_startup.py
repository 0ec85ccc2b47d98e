"""Start-up of `python -m runner` as a user meets it, each figure beside its target (`make bench`, or
`python -m benchmarks.bench_startup`; never asserted: it depends on the machine and what else runs on it).

Each case is a fresh process, measured two ways:
- wall seconds from starting the process to its exit (`--cfg job`, a typo) or to the end of its first
  optimizer step (the runs; a callback of this module, `FirstStep`, prints a line there, after which the
  run is interrupted, as on Ctrl-C);
- CPU seconds (user + system, every thread) of the process over the same span: at the first step the
  process reads its own clock (os.times), at its exit the parent reads the child's rusage. On a machine
  other processes load, the CPU figure is the steadier one. At the first step, the CPU seconds of the run's
  tracking process so far (runner/tracking/store_process.py: MLflow's import and the store's opening, on
  another core) are read from /proc and printed beside them ("+ tracking"); a whole run's rusage holds
  them, as the run waits for that process.

The default run's MLflow store is a fresh one for the first (untimed) run and an existing one for the
rest, as a user's is; what another case builds on its first run (gpt_small's token cache) is built by
an untimed run first. The default run's config is composed by that first run and taken from the cache of
composed configs by the rest, as a user's command run again is (runner/cli/compose_cache.py); a case beside
it has every run compose afresh. The cases run in turn, one run of each a round, and the default run's first
step is printed against the hand loop's as the median of their paired ratios (target: 1.1x). `--whole` also times whole default runs, paired with Lightning's run of the same
work (benchmarks/lightning_default.py) when lightning is importable: their CPU seconds and the ratio.
"""
from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from runner.addons.base import AddOn

FIRST_STEP_MARK = "first optimizer step done; CPU seconds "
FIRST_STEP = [f"trainer.callbacks=[{{_target_:benchmarks.bench_startup.FirstStep}}]"]  # the run's own add-on list, plus this


class FirstStep(AddOn):
    """Prints the process's CPU seconds once optimizer step 1 is done (on the main rank)."""

    name = "first_step_mark"

    def on_step_end(self, step, loss_sum, samples):
        if step == 1:
            cpu = os.times()
            print(f"{FIRST_STEP_MARK}{cpu.user + cpu.system:.3f} {_tracking_cpu():.3f}", flush=True)
        return None


def _tracking_cpu() -> float:
    """CPU seconds so far of this process's tracking processes (0 without one)."""
    from runner.tracking import store_process

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for process in list(store_process._live):
        try:
            fields = Path(f"/proc/{process.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


@dataclass(frozen=True)
class Case:
    what: str
    args: tuple[str, ...]
    to_first_step: bool   # False: to the process's exit
    target_s: float | None
    target_note: str = ""
    command: tuple[str, ...] = ()  # not `python -m runner <args>`: this module instead (a reference)
    composed_afresh: bool = False  # each run with an empty cache of composed configs (runner/cli/compose_cache.py)


DEFAULT_RUN = Case("default run: first optimizer step", (), True, 3.0)
HAND_LOOP = Case("hand-written loop, same work: first step", (), True, None, "reference",
                 ("-m", "benchmarks.hand_first_step"))
CASES = (
    Case("--cfg job", ("--cfg", "job"), False, 1.0),
    Case("a typo: optimzer=adamw (exit 2)", ("optimzer=adamw",), False, 1.0),
    DEFAULT_RUN,
    Case("  the same, its config composed afresh", (), True, None, "no cache", composed_afresh=True),
    Case("experiment=gpt_small: first step", ("experiment=gpt_small",), True, None, "7.3 before"),
    HAND_LOOP,
)
FIRST_STEP_RATIO = 1.1  # the default run's first step against the hand loop's, at most


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float
    code: int
    tracking_cpu: float = 0.0  # at the first step: the run's tracking process's CPU seconds so far


def _env() -> dict[str, str]:
    # the runs find this checkout (and FirstStep) wherever they start; one thread, as on a shared machine.
    # Python writes its bytecode cache as a user's does: where PYTHONDONTWRITEBYTECODE is set (some sandboxes and
    # CI images set it), a checkout installed in editable mode has no cache, and every run would compile
    # runner's ~85 modules again (0.1 s), which no user pays after their first run (the untimed one here)
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{root}:{path}" if path else root,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def timed(command: list[str], cwd: Path, to_first_step: bool, env: dict[str, str] | None = None) -> Timing:
    """Wall and CPU seconds of `command` (run in cwd, with env beside the bench's own) to its exit, or to its
    FirstStep line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        if to_first_step and line.startswith(FIRST_STEP_MARK):
            wall = time.perf_counter() - started
            proc.send_signal(signal.SIGINT)  # enough measured: the run ends KILLED, as on Ctrl-C
            proc.communicate()
            cpu, tracking = (float(f) for f in line[len(FIRST_STEP_MARK):].split())
            return Timing(wall, cpu, proc.returncode, tracking)
    code = proc.wait()
    wall = time.perf_counter() - started
    if to_first_step:
        raise RuntimeError(f"`{' '.join(command)}` never finished a first optimizer step: {''.join(seen[-3:]).strip()}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(wall, cpu, code)


def runner_command(args: tuple[str, ...], to_first_step: bool) -> list[str]:
    return [sys.executable, "-m", "runner", *args, *(FIRST_STEP if to_first_step else ())]


def _each(times: list[float]) -> str:
    return " ".join(f"{t:.2f}" for t in times)


def bench_startup(runs: int, whole: int = 0, python: str | None = None, cases: tuple[Case, ...] = CASES) -> None:
    """Prints the median of `runs` measurements of each case beside its target, the cases in turn in each of
    `runs` rounds (so a machine's drift reaches them all alike), then the default run's first step against
    the hand loop's (the median of their paired ratios); `whole` > 0: that many whole default runs, paired
    with Lightning's when it is importable."""
    print(f"{'start-up (python -m runner ...)':<38} {'wall s':>7} {'CPU s':>7} {'target s':>9}  verdict  "
          f"(each run: wall s / CPU s)")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        fresh = timed(runner_command((), True), cwd, True)  # creates and migrates outputs/mlflow.db
        for case in cases:
            if case.to_first_step and case.args:  # untimed: what a first run builds once (gpt_small's token cache)
                timed(runner_command(case.args, True), cwd, True)
        times: dict[Case, list[Timing]] = {case: [] for case in cases}
        for round_ in range(runs):
            for case in cases:
                command = [sys.executable, *case.command] if case.command else runner_command(case.args, case.to_first_step)
                env = {"XDG_CACHE_HOME": str(cwd / f"cache-{round_}")} if case.composed_afresh else None
                times[case].append(timed(command, cwd, case.to_first_step, env))
        for case in cases:
            _print_case(case, times[case])
        print(f"{'default run, fresh MLflow store':<38} {fresh.wall:>7.2f} {fresh.cpu:>7.2f} {'':>9}  {'':<7}  (once)")
        if runs and DEFAULT_RUN in times and HAND_LOOP in times:
            ours, hand = times[DEFAULT_RUN], times[HAND_LOOP]
            walls = [o.wall / h.wall for o, h in zip(ours, hand)]
            wall, cpu = statistics.median(walls), statistics.median(o.cpu / h.cpu for o, h in zip(ours, hand))
            within = sum(ratio <= FIRST_STEP_RATIO for ratio in walls)  # on a loaded machine, the pairs that met it
            print(f"first step, default run / hand loop (median of {runs} paired ratios): wall {wall:.3f}x, CPU "
                  f"{cpu:.3f}x  target <= {FIRST_STEP_RATIO}x (wall): {'ok' if wall <= FIRST_STEP_RATIO else 'over'} "
                  f"({within} of {runs} pairs within it; load {_load()})")
        if whole:
            whole_runs(whole, cwd, python)


def _load() -> str:
    """The machine's load averages over 1, 5 and 15 minutes ("unknown" where /proc does not say)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _print_case(case: Case, times: list[Timing]) -> None:
    wall, cpu = statistics.median(t.wall for t in times), statistics.median(t.cpu for t in times)
    target = f"{case.target_s:.1f}" if case.target_s is not None else case.target_note
    verdict = "" if case.target_s is None else "ok" if wall <= case.target_s else "over"
    tracking = (f" + tracking {_each([t.tracking_cpu for t in times])}"
                if any(t.tracking_cpu for t in times) else "")
    print(f"{case.what:<38} {wall:>7.2f} {cpu:>7.2f} {target:>9}  {verdict:<7}  "
          f"({_each([t.wall for t in times])} / {_each([t.cpu for t in times])}{tracking})", flush=True)


def lightning_python(given: str | None) -> str | None:
    """An interpreter that imports lightning: the one given, else this one where it can; None: neither."""
    for python in ([given] if given else [sys.executable]):
        found = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('lightning') is not None)"],
                               capture_output=True, text=True)
        if found.stdout.strip() == "True":
            return python
    return None


def whole_runs(runs: int, cwd: Path, python: str | None = None) -> None:
    """Whole default runs (20 epochs, MLflow on) alternating with Lightning's run of the same work (run by
    `python`, an interpreter that imports lightning, or this one)."""
    peer_python = lightning_python(python)
    peer = [peer_python, "-m", "benchmarks.lightning_default"] if peer_python else None
    if not (cwd / "outputs" / "mlflow.db").exists():  # a fresh store's creation is not a run's cost: made untimed
        timed(runner_command((), True), cwd, True)
    ours, theirs = [], []
    for _ in range(runs):
        ours.append(_succeeded(timed(runner_command((), False), cwd, False), "python -m runner"))
        if peer is not None:
            theirs.append(_succeeded(timed(peer, cwd, False), " ".join(peer)))
    cpu = statistics.median(t.cpu for t in ours)
    print(f"{'whole default run (20 epochs, MLflow)':<38} {statistics.median(t.wall for t in ours):>7.2f} {cpu:>7.2f} "
          f"{'':>9}  {'':<7}  ({_each([t.wall for t in ours])} / {_each([t.cpu for t in ours])})")
    if peer is None:
        print("Lightning's run of the same work: skipped (lightning is not importable; --lightning-python names an "
              "interpreter that has it)")
        return
    their_cpu = statistics.median(t.cpu for t in theirs)
    ratio = statistics.median(o.cpu / t.cpu for o, t in zip(ours, theirs))
    print(f"{'Lightning, the same work':<38} {statistics.median(t.wall for t in theirs):>7.2f} {their_cpu:>7.2f} "
          f"{'':>9}  {'':<7}  ({_each([t.wall for t in theirs])} / {_each([t.cpu for t in theirs])})")
    print(f"whole-run CPU, runner / Lightning (median of paired ratios): {ratio:.3f}  target < 1: "
          f"{'ok' if ratio < 1 else 'over'}")


def _succeeded(timing: Timing, what: str) -> Timing:
    if timing.code != 0:
        raise RuntimeError(f"`{what}` exited with code {timing.code}: its time says nothing")
    return timing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each start-up case (the median is printed)")
    parser.add_argument("--whole", type=int, default=0,
                        help="whole default runs, each paired with Lightning's when it is importable (0: none)")
    parser.add_argument("--lightning-python", default=None,
                        help="an interpreter that imports lightning, for its run (default: this one, where it can)")
    parser.add_argument("--only-whole", action="store_true", help="skip the start-up cases")
    parser.add_argument("--first-step-only", action="store_true",
                        help="of the start-up cases, the default run's (both ways) and the hand loop's first step")
    args = parser.parse_args(argv)
    if args.only_whole:
        with tempfile.TemporaryDirectory() as tmp:
            whole_runs(args.whole or 3, Path(tmp), args.lightning_python)
        return
    cases = tuple(c for c in CASES if c.to_first_step and not c.args) if args.first_step_only else CASES
    bench_startup(args.runs, args.whole, args.lightning_python, cases)


if __name__ == "__main__":
    main()
