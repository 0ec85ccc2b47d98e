"""`runner compare <experiment | parent run id | run ids...>`: runs side by side in the terminal.

A table of the runs sorted by their objective (the `objective` metric every run logs, ordered by its
`objective.direction` param), with status, duration and, as columns, only the params that differ between
them. `--plot val/loss` saves a chart of that metric over steps for those runs.

A sweep's size stays readable: the best `--top` runs only (default 20; the rest counted), each line
within the terminal's width (the param columns that do not fit continue in further blocks, each
starting with the run's #), and the chart's legend beside the axes, never over the curves.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from runner.tracking.mlflow_store import DEFAULT_URI
from runner.cli.preflight import fail
from runner.results.reproduce import OneLineParser, find_run, open_store, parse, refuse_deleted
from runner.specs.run import SpecError

# params that differ between any two runs without changing what was trained
_NOT_COMPARED = ("run_dir", "trial.", "tracking.", "trainer.resume", "trainer.progress_bar")
_WIDTH = 24  # a param value (or a run name) longer than this is cut in the table
TOP = 20     # runs shown by default: a sweep's best


def select_runs(client: Any, targets: list[str], uri: str) -> list[Any]:
    """An experiment's runs (sweep parents left out: their children are the runs), a parent run's
    children, or the runs named by id."""
    if len(targets) == 1:
        experiment = client.get_experiment_by_name(targets[0])
        if experiment is not None:
            runs = _search(client, [experiment.experiment_id], "")
            parents = {r.data.tags.get("mlflow.parentRunId") for r in runs}
            return [r for r in runs if r.info.run_id not in parents]
    runs = []
    for target in targets:
        run = find_run(client, target)
        if run is None:
            raise SpecError(f"compare: {target}: neither an experiment nor a run id in {uri}; name an experiment "
                            f"(tracking.experiment, default 'runner'), a sweep's parent run or run ids, or pass "
                            f"--uri with their store")
        refuse_deleted(run, "compare")
        children = _search(client, [run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
        runs.extend(children if len(targets) == 1 and children else [run])
    return runs


def _search(client: Any, experiments: list[str], query: str) -> list[Any]:
    from mlflow.entities import ViewType

    runs, token = [], None
    while True:
        page = client.search_runs(experiments, query, ViewType.ACTIVE_ONLY, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def ranked(runs: list[Any]) -> list[Any]:
    """Best objective first; runs without one (failed, pruned early, still running) last."""
    def key(run: Any) -> tuple[int, float]:
        value = run.data.metrics.get("objective")
        if value is None or math.isnan(value):
            return (1, 0.0)
        maximize = run.data.params.get("objective.direction", "maximize") == "maximize"
        return (0, -value if maximize else value)

    return sorted(runs, key=key)


def differing_params(runs: list[Any]) -> list[str]:
    keys = sorted({k for r in runs for k in r.data.params if not k.startswith(_NOT_COMPARED)})
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


def table(runs: list[Any], width: int | None = None) -> list[str]:
    """The runs' rows, in blocks no wider than `width` (the terminal's): the fixed columns and the params that
    fit, then the params that did not, each further block led by the run's #."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    columns = differing_params(runs)
    fixed = ["#", "run", "run id", "status", "duration", "objective"]
    rows = []
    for i, run in enumerate(runs, 1):
        objective = run.data.metrics.get("objective")
        rows.append([str(i), _cut(run.info.run_name or ""), run.info.run_id[:12], run.data.tags.get("runner.outcome",
                     run.info.status).lower(), _duration(run), "-" if objective is None else f"{objective:.6g}",
                     *[_cut(run.data.params.get(k, "-")) for k in columns]])
    header = [*fixed, *columns]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    blocks, lead, start = [], list(range(len(fixed))), len(fixed)
    while True:
        used, chosen = sum(widths[i] + 2 for i in lead), list(lead)
        # a further block takes at least one param, however wide: else a too-wide one would never be shown
        while start < len(header) and (used + widths[start] <= width or (len(chosen) == len(lead) and blocks)):
            chosen.append(start)
            used += widths[start] + 2
            start += 1
        blocks.append(chosen)
        if start >= len(header):
            break
        lead = [0]
    lines = []
    for n, chosen in enumerate(blocks):
        if n:
            lines.append("")
        lines += ["  ".join(str(row[i]).ljust(widths[i]) for i in chosen).rstrip() for row in [header, *rows]]
    return lines


def _duration(run: Any) -> str:
    if not run.info.end_time:
        return "running"
    seconds = (run.info.end_time - run.info.start_time) / 1000
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _cut(value: str) -> str:
    return value if len(value) <= _WIDTH else value[:_WIDTH - 3] + "..."


def plot(client: Any, runs: list[Any], metric: str, out: Path) -> Path:
    histories = {run.info.run_id: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric))
                 for run in runs}
    import matplotlib.pyplot as plt

    fig = draw(histories, runs, metric)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")  # tight: the legend beside the axes is kept in the file
    plt.close(fig)
    return out


def draw(histories: dict[str, list[tuple[int, float]]], runs: list[Any], metric: str) -> Any:
    """The chart: one curve per run, the legend outside the axes (at a sweep's size it would cover them)."""
    import matplotlib
    import matplotlib.ticker as ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        points = histories[run.info.run_id]
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 30 else None,
                    label=f"{_cut(run.info.run_name or '')} ({run.info.run_id[:8]})")
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    ax.grid(alpha=0.3)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="runner compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="+", help="an experiment name, a sweep's parent run id, or run ids")
    parser.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI),
                        help=f"the MLflow store (default: {DEFAULT_URI}; tracking.uri=... works too)")
    parser.add_argument("--plot", metavar="METRIC", help="save a chart of this metric over steps, e.g. val/loss")
    parser.add_argument("--out", help="the chart's file (default: outputs/compare/<metric>.png)")
    parser.add_argument("--top", type=int, default=TOP, metavar="N",
                        help=f"show the best N runs, in the table and the chart (default {TOP}; 0: all)")
    args = parse(parser, argv)
    try:
        client = open_store(args.uri)
        runs = ranked(select_runs(client, args.targets, args.uri))
        if not runs:
            raise SpecError(f"compare: {' '.join(args.targets)}: holds no runs yet")
        if args.plot and not any(args.plot in r.data.metrics for r in runs):  # before any output: one line only
            held = sorted({k for r in runs for k in r.data.metrics})
            raise SpecError(f"--plot: {args.plot}: none of these runs logged it; they log {', '.join(held)}")
        if args.top < 0:
            raise SpecError(f"--top: {args.top}; allowed: a number of runs >= 1, or 0 for all")
        left_out = len(runs) - args.top if args.top and len(runs) > args.top else 0
        runs = runs[:len(runs) - left_out]
        for line in table(runs):
            print(line)
        if left_out:
            print(f"... and {left_out} more run{'s' if left_out > 1 else ''}, not as good (--top 0 shows all)")
        if args.plot:
            out = Path(args.out or f"outputs/compare/{re.sub(r'[^A-Za-z0-9_.-]+', '_', args.plot)}.png")
            print(f"chart of {args.plot}: {plot(client, runs, args.plot, out).resolve()}")
    except SpecError as e:
        fail(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
