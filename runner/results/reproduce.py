"""`runner reproduce <MLflow run id>` (or `python -m runner.results.reproduce <id>`): rerun a run from its MLflow
record alone.

The run's spec.yaml artifact is the whole recipe; its run record (runner/tracking/run_record.py) says what else
the result depends on. Whatever differs between then and now (commit, uncommitted diff, the source of any
module the run imported, packages, data, hardware) is printed before the rerun, and the final metrics of both runs side by side after it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from runner.tracking.mlflow_store import DEFAULT_URI, sqlite_path
from runner.cli.preflight import fail
from runner.specs.run import RunSpec, SpecError

TAG = "runner.reproduces"
# metrics that measure the machine's speed at that moment, not what was trained
TIMING_PREFIXES = ("throughput/", "time/", "perf/", "profile/", "compile", "memory/", "data_wait")


def open_store(uri: str) -> Any:
    """The MLflow client on an existing store: a missing sqlite file is a mistake here, not a new store."""
    path = sqlite_path(uri)
    if path is not None and not path.exists():
        raise SpecError(f"--uri: {uri}: no MLflow store at {path}; name the store the run was logged to "
                        f"(default {DEFAULT_URI}, relative to the directory you ran in)")
    from runner.tracking.mlflow_store import open_client

    return open_client(uri, end_orphans=False)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose complaints are runner's one line (`error: ...`, exit 2), not its usage block."""

    def error(self, message: str):
        fail(f"{self.prog.removeprefix('runner ')}: {message}; usage: {' '.join(self.format_usage().split()[1:])}")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments; `tracking.uri=X`, the key a run is given its store with, is taken for `--uri X`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    uris = [a.split("=", 1)[1] for a in argv if a.startswith("tracking.uri=")]
    args = parser.parse_args([a for a in argv if not a.startswith("tracking.uri=")])
    if uris:
        args.uri = uris[-1]
    return args


def find_run(client: Any, run_id: str) -> Any | None:
    """The run with this id, or with this unique id prefix (as `runner compare` shows ids); None if none."""
    try:
        return client.get_run(run_id)
    except Exception:
        pass
    if len(run_id) < 6 or not all(c in "0123456789abcdef" for c in run_id):
        return None
    from mlflow.entities import ViewType

    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    found = [r for r in client.search_runs(experiments, "", ViewType.ALL, max_results=50000)
             if r.info.run_id.startswith(run_id)] if experiments else []
    return found[0] if len(found) == 1 else None


def refuse_deleted(run: Any, key: str) -> Any:
    """The run, unless it was deleted (MLflow keeps a deleted run until `mlflow gc`): nothing is read from it."""
    if run.info.lifecycle_stage == "deleted":
        raise SpecError(f"{key}: {run.info.run_id}: the MLflow run was deleted; restore it first (mlflow runs restore "
                        f"--run-id {run.info.run_id}) or name another run")
    return run


def get_run(client: Any, run_id: str, uri: str) -> Any:
    run = find_run(client, run_id)
    if run is None:
        raise SpecError(f"run id: {run_id}: no such MLflow run in {uri}; copy the id from the run's page or "
                        f"summary, or pass --uri with the store it was logged to")
    return refuse_deleted(run, "run id")


def load_artifact(client: Any, run_id: str, name: str) -> str | None:
    import tempfile

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per file read would bury the output
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return Path(client.download_artifacts(run_id, name, tmp)).read_text()
    except Exception:
        return None


def differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per thing that differs between two run records (runner/tracking/run_record.py's build)."""
    out = []

    def same(what: str, a: Any, b: Any) -> None:
        if a != b:
            out.append(f"{what}: {_short(a)} then, {_short(b)} now")

    g0, g1 = then.get("git", {}), now.get("git", {})
    same("working directory (relative data paths resolve against it)", g0.get("cwd"), g1.get("cwd"))
    same("git commit", g0.get("commit"), g1.get("commit"))
    same("uncommitted changes (sha256 of git diff HEAD)", g0.get("diff_sha256"), g1.get("diff_sha256"))
    same("runner's source commit", (g0.get("runner_source") or {}).get("commit"),
         (g1.get("runner_source") or {}).get("commit"))
    for kind in ("packages", "hardware"):
        a, b = then.get(kind, {}), now.get(kind, {})
        for key in sorted(set(a) | set(b)):
            same(f"{kind[:-1] if kind == 'packages' else kind} {key}", a.get(key, "not installed"),
                 b.get(key, "not installed"))
    d0, d1 = then.get("data", {}), now.get("data", {})
    same("data params", d0.get("params"), d1.get("params"))
    p0, p1 = d0.get("paths", {}), d1.get("paths", {})
    for key in sorted(set(p0) | set(p1)):
        same(f"data {key}", p0.get(key, "missing"), p1.get(key, "missing"))
    s1 = now.get("sources", {})
    for name, entry in sorted(then.get("sources", {}).items()):  # the modules the run imported, as they are now
        sha = (s1.get(name) or {}).get("sha256", "missing")
        if sha != entry["sha256"]:
            out.append(f"source of {name} ({entry['file']}): {entry['sha256']} then, {sha} now")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 160 else text[:157] + "..."


def rerun_spec(spec: RunSpec, original: Any, uri: str, run_dir: Path) -> RunSpec:
    """The same spec as a fresh, standalone run: not a resume, not a trial of the original's study. An
    evaluation, prediction or export keeps its source: its spec names the very weights file and average it
    took (runner/results/source.py), so the rerun takes the same weights."""
    from runner.specs.trial import TrialSpec

    name = f"{original.info.run_name} (reproduced)"
    resume = spec.trainer.resume if spec.mode != "train" else None
    return spec.replace(run_dir=str(run_dir), trainer=dataclasses.replace(spec.trainer, resume=resume),
                        trial=TrialSpec(), tracking=dataclasses.replace(spec.tracking, uri=uri, run_name=name))


def compared(then: dict[str, float], now: dict[str, float]) -> list[str]:
    """The final metrics both records are compared on: every one but the timings."""
    return sorted(k for k in set(then) | set(now) if not k.startswith(TIMING_PREFIXES))


def side_by_side(then: dict[str, float], now: dict[str, float]) -> list[str]:
    keys = compared(then, now)
    width = max([len(k) for k in keys] + [13])
    lines = [f"{'final metric':<{width}}  {'original':>22}  {'reproduced':>22}"]
    equal = 0
    for key in keys:
        a, b = then.get(key), now.get(key)
        equal += a == b
        mark = "equal" if a == b else "DIFFERS"
        lines.append(f"{key:<{width}}  {_num(a):>22}  {_num(b):>22}  {mark}")
    timings = sorted(k for k in set(then) | set(now) if k.startswith(TIMING_PREFIXES))
    lines.append(f"{equal} of {len(keys)} final metrics equal" + (f" (timings not compared: {', '.join(timings)})"
                                                                   if timings else ""))
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else repr(value)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="runner reproduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_id", help="the MLflow run id (its run page, or the run summary, shows it)")
    parser.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI),
                        help=f"the MLflow store the run is in (default: {DEFAULT_URI}; tracking.uri=... works too)")
    parser.add_argument("--run-dir", help="the new run's directory (default: outputs/reproduce/<id>-<time>)")
    args = parse(parser, argv)
    try:
        client = open_store(args.uri)
        original = get_run(client, args.run_id, args.uri)
        args.run_id = original.info.run_id
        text = load_artifact(client, args.run_id, "spec.yaml")
        if text is None:
            raise SpecError(f"run id: {args.run_id}: the run has no spec.yaml artifact, so nothing to rerun it from "
                            f"(a sweep's parent run has none: its jobs are listed by `runner compare {args.run_id}`)")
        spec = RunSpec.from_yaml(text)
    except SpecError as e:
        fail(str(e))
    import torch  # noqa: F401  (imported before the record: it names the CUDA build as the run's own record did)

    from runner.tracking import run_record

    record_text = load_artifact(client, args.run_id, run_record.RECORD_FILE)
    now = run_record.build(spec)
    now["git"].pop("diff")
    if record_text is None:
        print(f"reproduce: run {args.run_id} has no {run_record.RECORD_FILE}: commit, packages and data cannot be "
              f"compared")
    else:
        then = json.loads(record_text)
        now["sources"] = run_record.sources_now(then.get("sources", {}))  # the files the run imported, not this process's
        found = differences(then, now)
        print(f"reproduce: {len(found)} difference(s) between run {args.run_id} and now" + (":" if found else ""))
        for line in found:
            print(f"  differs: {line}")
    run_dir = Path(args.run_dir or f"outputs/reproduce/{args.run_id[:8]}-{time.strftime('%Y%m%d-%H%M%S')}")
    spec = rerun_spec(spec, original, args.uri, run_dir.resolve())
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    from runner.cli.launch import run
    from runner.tracking.tracker import RUN_FILE

    try:
        run(spec)
    except SpecError as e:
        fail(str(e))
    finally:
        run_file = run_dir / RUN_FILE
        new_id = run_file.read_text().strip() if run_file.exists() else None
        if new_id:
            client.set_tag(new_id, TAG, args.run_id)
    print(f"reproduce: run {new_id} reran run {args.run_id} (tagged {TAG}={args.run_id})")
    then, now = original.data.metrics, client.get_run(new_id).data.metrics
    for line in side_by_side(then, now):
        print(line)
    differ = [k for k in compared(then, now) if then.get(k) != now.get(k)]
    if differ:  # like diff(1): 1 when the rerun did not reproduce the numbers
        print(f"reproduce: {len(differ)} final metric(s) differ: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
