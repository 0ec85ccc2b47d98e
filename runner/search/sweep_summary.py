"""The end of a multirun (grid or Optuna study): a table of its jobs on the console and in the sweep
directory, the best one marked, the parent MLflow run's link; on the parent run, the best child tagged,
`best_value`, and the same table as the artifact jobs.csv.

Printed, not logged: in a multirun the root logger still writes to the last job's runner.log.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runner.tracking.mlflow_store import DEFAULT_URI, experiment_page


@dataclass
class Job:
    number: int
    overrides: str                 # what the user swept, as typed (no runner-internal keys)
    objective: Optional[float]     # None: the job gave no value (failed, pruned, killed)
    status: str                    # complete | pruned | failed | killed
    seconds: Optional[float]
    run_id: Optional[str] = None   # its MLflow child run
    params: dict[str, str] = field(default_factory=dict)


def best_job(jobs: list[Job], maximize: bool) -> Optional[Job]:
    done = [j for j in jobs if j.status == "complete" and j.objective is not None and not math.isnan(j.objective)]
    if not done:
        return None
    return (max if maximize else min)(done, key=lambda j: j.objective)


def table(jobs: list[Job], best: Optional[Job], metric: str) -> str:
    """One line per job; `*` marks the best."""
    # the overrides every job shares (a fixed key, the store's URI) say nothing about which job is which
    shared = set.intersection(*(set(j.overrides.split()) for j in jobs)) if len(jobs) > 1 else set()
    rows = [("", "#", "overrides", metric, "status", "time")]
    for j in sorted(jobs, key=lambda j: j.number):
        swept = " ".join(o for o in j.overrides.split() if o not in shared)
        rows.append(("*" if j is best else "", str(j.number), swept or "(none)",
                     "-" if j.objective is None else f"{j.objective:.4f}", j.status,
                     "-" if j.seconds is None else f"{j.seconds:.1f} s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def as_csv(jobs: list[Job], metric: str) -> str:
    keys = sorted({k for j in jobs for k in j.params})
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["job", *keys, metric, "status", "seconds", "run_id"])
    for j in sorted(jobs, key=lambda j: j.number):
        writer.writerow([j.number, *(j.params.get(k, "") for k in keys), "" if j.objective is None else j.objective,
                         j.status, "" if j.seconds is None else round(j.seconds, 3), j.run_id or ""])
    return out.getvalue()


def run_link(client: Any, uri: str, run_id: str) -> str:
    """Where to see the parent run (the local store needs `make ui` first)."""
    experiment = client.get_run(run_id).info.experiment_id
    if uri.startswith("http"):
        return experiment_page(uri, experiment, None).replace("/runs?", f"/runs/{run_id}?")
    ui = "make ui" if uri == DEFAULT_URI else f"python -m runner.tracking.mlflow_ui --backend-store-uri {uri}"
    page = experiment_page("http://127.0.0.1:5000", experiment, None)
    return f"{ui}, then " + page.replace("/runs?", f"/runs/{run_id}?")


def mark_best(client: Any, parent_run_id: str, jobs: list[Job], best: Optional[Job]) -> None:
    """A grid's parent as a study's: the best child tagged runner.best (the others false), best_value,
    best_job and the best job's overrides on the parent."""
    from mlflow.entities import Metric, RunTag

    for j in jobs:
        if j.run_id is not None:
            client.set_tag(j.run_id, "runner.best", "true" if j is best else "false")
    if best is not None:
        client.log_batch(parent_run_id, metrics=[Metric("best_value", best.objective, 0, best.number)],
                         tags=[RunTag("best_job", str(best.number)), RunTag("best.overrides", best.overrides[:5000])])


def log_jobs_table(client: Any, parent_run_id: str, jobs: list[Job], metric: str, sweep_dir: Path) -> None:
    """jobs.csv (every child's params and objective) in the sweep directory and on the parent run."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / "jobs.csv"
    path.write_text(as_csv(jobs, metric))
    client.log_artifact(parent_run_id, str(path))


def print_summary(jobs: list[Job], best: Optional[Job], metric: str, sweep_dir: Path, link: Optional[str]) -> None:
    text = table(jobs, best, metric)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "jobs.txt").write_text(text + "\n")
    lines = [f"runner: {len(jobs)} jobs in {sweep_dir}" + (f" (* best {metric}: {best.objective:.4f})" if best else ""),
             text]
    if link:
        lines.append(f"parent MLflow run: {link}")
    print("\n".join(lines), flush=True)
