"""A run's store calls other than its metrics, as data: a kind and JSON args, so the run directory's
journal (runner/tracking/journal.py) can hold each one until the store confirms it, and whoever completes
the run (the writer's thread now, a resume or the next opening of the store later) makes it the same way.

Kinds and their args:
  params    {"params": {key: value}}
  tags      {"tags": {key: value}}
  text      {"text": str, "file": artifact file}
  artifact  {"path": local file or directory, "artifact_path": folder in the run's artifacts or None}
  record    {} before the run record is built; {"tags": ..., "texts": {file: text}} once it is
            (a record never built is built by whoever makes the call, from the run directory's spec.yaml)
  views     {"experiment_id": id, "views": the runs table's saved views} (made by mlflow_store.make_call,
            whose views they are)
  model     {"dir": a saved MLflow model, "name", "step", "tags", "source"}: the logged model
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
UPLOAD_TAG = "runner.upload"  # a logged model's: the saved model it was made from, for a retry to find


def make(client: Any, run_id: str, kind: str, args: dict) -> None:
    """Call `kind` on run_id with args; raises what the store raises (the writer retries or keeps it)."""
    from mlflow.entities import Param, RunTag

    if kind == "params":
        params = [Param(k, str(v)) for k, v in args["params"].items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            client.log_batch(run_id, params=params[i:i + 100])
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in args["tags"].items()])
    elif kind == "text":
        client.log_text(run_id, args["text"], args["file"])
    elif kind == "artifact":
        path = Path(args["path"])
        if path.exists():  # a folder lands under its own name
            client.log_artifact(run_id, str(path), args.get("artifact_path"))
        else:
            log.warning("MLflow: %s is gone; not stored with run %s", path, run_id)
    elif kind == "record":
        if "tags" not in args:
            args.update(built_record(client, run_id))
        client.log_batch(run_id, tags=[RunTag(k, v[:5000]) for k, v in args["tags"].items()])
        for file, text in args["texts"].items():
            client.log_text(run_id, text, file)
    elif kind == "model":
        upload_model(client, run_id, args)
    else:
        raise ValueError(f"unknown store call {kind!r}")


def record_args(spec: Any) -> dict:
    """The run record's call args, built now (git, packages, hardware: seconds, off the training thread)."""
    from runner.tracking import run_record

    record = run_record.build(spec)
    diff = record["git"].pop("diff")
    texts = {run_record.RECORD_FILE: json.dumps(record, indent=1, default=str)}
    if diff:
        texts[run_record.DIFF_FILE] = diff
    return {"tags": run_record.tags(record), "texts": texts}


def built_record(client: Any, run_id: str) -> dict:
    """A record whose process died before building it: built now, from the run directory's spec.yaml."""
    from runner.specs.run import RunSpec

    run_dir = client.get_run(run_id).data.tags.get("run_dir", "")
    return record_args(RunSpec.from_yaml((Path(run_dir) / "spec.yaml").read_text()))


def upload_model(client: Any, run_id: str, args: dict) -> None:
    """A model saved in the run directory while the store could not be reached (mlflow.pytorch.save_model),
    logged to the run as mlflow.pytorch.log_model would have: a logged model of the run at args["step"], with
    the run's params, its artifacts, READY; and the run's runner.logged_model tag naming it."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    run = client.get_run(run_id)
    upload = f"{args['source']} from {args['dir']}"
    if "model_id" in args:  # an earlier try created it, then the store went away
        model = client.get_logged_model(args["model_id"])
    else:  # a try whose process or journal kept no id (a replay from the journal) finds it by its upload tag
        made = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
        model = next((m for m in made if m.tags.get(UPLOAD_TAG) == upload), None)
        if model is None:
            model = client.create_logged_model(run.info.experiment_id, name=args["name"], source_run_id=run_id,
                                               tags={**args["tags"], UPLOAD_TAG: upload}, params=dict(run.data.params))
        args["model_id"] = model.model_id
    if model.model_id not in {o.model_id for o in getattr(run.outputs, "model_outputs", None) or []}:
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=args["step"])])
    if str(model.status).endswith("READY"):  # logged whole by a try that died before its confirmation
        client.set_tag(run_id, "runner.logged_model", f"models:/{model.model_id} ({args['source']})")
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "model"
        shutil.copytree(args["dir"], local)
        described = Model.load(str(local / "MLmodel"))  # what save_model wrote, now naming the logged model
        described.artifact_path, described.run_id = model.artifact_location, run_id
        described.model_id, described.model_uuid = model.model_id, model.model_id
        described.save(str(local / "MLmodel"))
        client.log_model_artifacts(model.model_id, str(local))
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.set_tag(run_id, "runner.logged_model", f"models:/{model.model_id} ({args['source']})")
