"""One member's round: train from where the member is to the round's boundary (trainer.stop_at_step),
or to its end in the last round, in this process, as `python -m runner.search.pbt.member <job.json>`, or as
a job of the Hydra launcher the user chose (runner/search/pbt/launcher.py's member_task).

The job file names the member's spec (its run directory, its hyperparameters, `trainer.resume` after
the first round), the population's MLflow parent run, the hyperparameters to log as metrics at the step
the round starts from and the lineage tags. The result, written next to it, is the objective at the
boundary (the last validation, not the best so far: PBT compares members where they are now); a member
whose loss diverged in the round has a NaN objective (its MLflow run FAILED, tagged pbt.diverged), so it
ranks last and copies a better member, as a failed trial is recorded rather than fatal in the Optuna sweeper.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from runner.engine import checkpoint, preemption

from runner.cli import lifetime, process_state
from runner.specs.run import RunSpec, SpecError

log = logging.getLogger(__name__)
SWEEP_PID_ENV = "RUNNER_PBT_SWEEP_PID"  # the sweep process that started this member: it stops when that is gone


def run_job(job_file: Path) -> dict[str, Any]:
    """Run the round a job file describes; its result is also written to job["result"]."""
    from mlflow.entities import Metric

    from runner.engine.engine import Engine
    from runner.engine.monitor import Diverged
    from runner.search.pbt.explore import mlflow_key
    from runner.search.pbt.mutable import MidRunChanges
    from runner.tracking.tracker import build_tracker

    job = json.loads(Path(job_file).read_text())
    spec = RunSpec.from_yaml(job["spec"])
    run_dir = Path(spec.run_dir)
    if not spec.trainer.resume and checkpoint.has_checkpoint(run_dir):  # a job run again (a requeued SLURM job)
        spec = spec.replace(trainer=dataclasses.replace(spec.trainer, resume=str(run_dir)))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.yaml").write_text(spec.to_yaml())
    with process_state.isolated(), preemption.handled():
        # explore's new values reach the resumed optimizer and schedule through PBT's add-on
        engine = Engine(spec, build_tracker(spec, 0, parent_run_id=job.get("parent_run_id")), addons=[MidRunChanges()])
        start, began = engine.progress.step, time.perf_counter()
        tags = dict(job.get("tags", {}))
        try:
            result = engine.fit()
        except Diverged as e:  # a failed member, not a failed population: it ranks last and is exploited
            log.warning("PBT member %s diverged: %s", tags.get("pbt.member", "?"), e)
            result, tags["pbt.diverged"] = None, str(e)
        client = getattr(engine.tracker, "client", None)
        if client is not None and engine.tracker.run_id:
            now = int(time.time() * 1000)
            # the values in force from the step after the round's start on, logged at the step they changed: the
            # round's start, also when this attempt resumed a round stopped later (a signal's checkpoint)
            changed_at = job.get("round_start", start)
            metrics = [Metric(f"pbt/{mlflow_key(k)}", float(v), now, changed_at) for k, v in job.get("hparams", {}).items()]
            client.log_batch(engine.tracker.run_id, metrics=metrics, tags=[_tag(k, v) for k, v in tags.items()])
    history = engine.monitor.history.get(spec.objective.metric, [])
    if result is None:
        out = {"step": engine.progress.step, "objective": math.nan, "best": math.nan, "diverged": tags["pbt.diverged"],
               "run_id": engine.tracker.run_id or "", "seconds": time.perf_counter() - began, "finished": False}
    else:
        out = {"step": engine.progress.step, "objective": history[-1][1] if history else math.nan,
               "best": result.objective, "run_id": engine.tracker.run_id or "", "seconds": result.seconds,
               "finished": engine.finished}
    Path(job["result"]).write_text(json.dumps(out))
    return out


def _tag(key: str, value: Any):
    from mlflow.entities import RunTag

    return RunTag(key, str(value)[:5000])


def watch_sweep(sweep_pid: int, every_s: float = 0.5) -> threading.Thread:
    """A thread that sends this process SIGTERM once the sweep that started it is gone (killed, even by
    SIGKILL): the member then stops as a signalled run does, its checkpoint written and its run KILLED,
    rather than training on with nobody to read its result; killed if it has not stopped after a grace period."""
    return lifetime.end_with_parent(sweep_pid, every_s=every_s)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if os.environ.get(SWEEP_PID_ENV):
        watch_sweep(int(os.environ[SWEEP_PID_ENV]))
    try:
        run_job(Path(argv[0]))
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except preemption.Stopped as e:
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
