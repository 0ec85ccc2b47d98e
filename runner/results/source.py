"""The trained run that `mode=eval|predict|export` works on: `trainer.resume=<run dir | checkpoint file |
MLflow run id>` resolved to a checkpoint file, the spec it was trained with, and its MLflow run.

A run id is looked up in this invocation's tracking store: the run's `run_dir` tag (every run logs it)
names the directory whose checkpoints hold the weights; MLflow itself holds no checkpoint."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from runner.spec.fields import SpecError
from runner.tracking.tracker import RUN_FILE

_RUN_ID = re.compile(r"[0-9a-f]{32}")  # MLflow's run ids: uuid4 hex


def resolve_source(spec) -> tuple[Path, dict, str | None]:
    """(checkpoint file, the source run's spec as a dict, its MLflow run id or None) for spec.trainer.resume."""
    from runner.engine import checkpoint

    target = spec.trainer.resume
    run_id = None
    if not Path(target).exists() and _RUN_ID.fullmatch(target):
        run_id, target = target, _run_dir_of(target, spec)
    path = checkpoint.verify(target)  # a directory: its newest checkpoint that passes its checksum
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    text = checkpoint.read_spec(path)
    if text is None:  # a checkpoint written before checkpoints held their spec
        if not (run_dir / "spec.yaml").is_file():
            raise SpecError(f"trainer.resume: {path} holds no run spec and no spec.yaml lies beside it")
        text = (run_dir / "spec.yaml").read_text()
    if run_id is None and (run_dir / RUN_FILE).is_file():
        run_id = (run_dir / RUN_FILE).read_text().strip() or None
    return path, yaml.safe_load(text), run_id


def check_at_start(spec) -> None:
    """The CLI's check before the run starts: the source exists (a run id is looked up when the run starts,
    as it needs the MLflow store) and predict.input names something to read."""
    from runner.spec.resume import check_source

    given = spec.predict.input
    if spec.mode == "predict" and given is not None and not Path(given).exists():
        raise SpecError(f"predict.input: {given!r} does not exist; give a folder of images or a text file with "
                        "one input per line")
    target = spec.trainer.resume
    if not (not Path(target).exists() and _RUN_ID.fullmatch(target)):
        check_source(target)


def _run_dir_of(run_id: str, spec) -> str:
    if spec.tracking.name == "none":
        raise SpecError(f"trainer.resume: {run_id} is no run directory or checkpoint file, and tracking=none cannot "
                        "look it up as an MLflow run id; give the run directory instead")
    from runner.tracking.mlflow_store import open_client

    client = open_client(spec.tracking.uri)
    try:
        run = client.get_run(run_id)
    except Exception:
        raise SpecError(f"trainer.resume: {run_id} is no run directory, checkpoint file or MLflow run in "
                        f"{spec.tracking.uri}; give one of those") from None
    run_dir = run.data.tags.get("run_dir")
    if not run_dir or not Path(run_dir).is_dir():
        raise SpecError(f"trainer.resume: MLflow run {run_id} names the run directory {run_dir!r}, which is not "
                        "here; give the run directory or a checkpoint file instead")
    return run_dir
