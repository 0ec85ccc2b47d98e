"""The trained run that `mode=eval|predict|export` works on: `trainer.resume=<run dir | checkpoint file |
MLflow run id>` resolved to its weights (`weights.which`, `weights.average`: runner/engine/run_weights.py),
the checkpoint file holding them, the spec it was trained with, and its MLflow run.

A run id is looked up in this invocation's tracking store: the run's `run_dir` tag (every run logs it)
names the directory whose checkpoints hold the weights; MLflow itself holds no checkpoint."""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import yaml

from runner.specs.fields import SpecError, set_dotted
from runner.tracking.tracker import RUN_FILE

if TYPE_CHECKING:
    from runner.engine.run_weights import RunWeights

_RUN_ID = re.compile(r"[0-9a-f]{32}")  # MLflow's run ids: uuid4 hex
# how and where this invocation runs and logs, and which weights it takes: never the source run's
_OWN_KEYS = ("mode", "eval", "predict", "weights", "tracking", "parallelism", "run_dir", "overrides")


class Source(NamedTuple):
    path: Path               # the checkpoint file holding the weights (a best file, or a step checkpoint)
    spec: dict               # the spec the run trained with
    run_id: str | None       # its MLflow run
    weights: RunWeights      # the weights chosen


def resolve_source(spec) -> Source:
    """The trained run spec.trainer.resume names, and the weights of it that spec.weights chooses."""
    from runner.engine import run_weights

    target = spec.trainer.resume
    run_id = None
    if not Path(target).exists() and _RUN_ID.fullmatch(target):
        run_id, target = target, _run_dir_of(target, spec)
    weights = run_weights.read(target, spec.weights.which, spec.weights.average)
    path = weights.path
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    text = weights.spec
    if text is None:  # a checkpoint written before checkpoints held their spec
        if not (run_dir / "spec.yaml").is_file():
            raise SpecError(f"trainer.resume: {path} holds no run spec and no spec.yaml lies beside it")
        text = (run_dir / "spec.yaml").read_text()
    if run_id is None and (run_dir / RUN_FILE).is_file():
        run_id = (run_dir / RUN_FILE).read_text().strip() or None
    return Source(path, yaml.safe_load(text), run_id, weights)


def source_spec(spec) -> tuple:
    """The spec this invocation runs (the source run's, with what was typed now on top) and its Source. The
    spec names the chosen weights' own file and average, so it reruns on exactly them (runner reproduce)."""
    from runner.specs.resume import typed_keys
    from runner.specs.run import RunSpec

    source = resolve_source(spec)
    merged = copy.deepcopy(source.spec)  # source.spec stays the trained run's (misfit names its values)
    now, typed = spec.to_dict(), typed_keys(spec.overrides)
    for key in typed:
        if key.endswith("."):  # a group choice (dataset=imagefolder): the whole option, not a mix of two
            group = key[:-1]
            # the loader's keys are the run's, not the option's: the source's batch unless typed now
            kept = {k: merged[group][k] for k in ("batch_size", "num_workers") if group == "dataset" and f"dataset.{k}" not in typed}
            merged[group] = {**now[group], **kept}
        elif key.split(".")[0] not in _OWN_KEYS:
            set_dotted(merged, key, _get(now, key))
    merged.update({k: now[k] for k in _OWN_KEYS})
    merged["trainer"]["resume"] = str(source.path)
    merged["weights"] = {"which": "tested", "average": source.weights.average}  # a file is its own choice
    merged["model"].pop("weights", None)  # the checkpoint's weights replace any starting weights
    return RunSpec.from_yaml(yaml.safe_dump(merged, sort_keys=False)), source


def load_engine(spec, source: Source, tracker=None, averages: bool = False):
    """An Engine of spec holding the source's chosen weights (nothing else of the run's training state). averages:
    the raw weights in the model and the run's averages in the engine's (mode=eval evaluates each). Weights that
    do not fit the model are refused under the key typed now that changed the model (or its data's shape)."""
    from torch.distributed.checkpoint import CheckpointException  # a BaseException: DCP's read of a mismatch

    from runner.engine.engine import Engine

    weights = source.weights
    # the weights are loaded here: the engine must not resume the optimizer, schedule or data position
    engine = Engine(spec.replace(trainer=dataclasses.replace(spec.trainer, resume=None)), tracker)
    try:
        if averages:  # the raw weights and the averages' values in one read, whatever mesh wrote them
            from runner.engine import parallel

            state = parallel.flat_full_state(weights.state) if "model" in weights.state else weights.path
            parallel.load_sharded(engine.module, None, state, extra=engine.averages.sharded_state(),
                                  optional=(parallel.AVERAGES,))
            engine.averages.load_state_dict(weights.averages)
        else:
            weights.load_into(engine.module)
    except (RuntimeError, KeyError, ValueError, SpecError, CheckpointException) as e:
        raise SpecError(misfit(spec, source, e)) from None
    engine.model.eval()
    return engine


def misfit(spec, source: Source, error: BaseException) -> str:
    """The line for a source's weights that do not fit the model built now: it names the key typed on this
    command line that made the model (or the data's shape) differ from the one the run trained, its value and
    the trained run's; trainer.resume when nothing typed explains it (the checkpoint then holds other weights)."""
    from runner.specs.resume import typed_keys

    if type(error).__name__ == "CheckpointException":  # DCP's: each rank's own error and its traceback
        error = next((failure[0] for failure in error.failures.values()), error)
    detail = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    detail = str(detail).splitlines()[0] if str(detail).strip() else type(error).__name__
    if isinstance(error, SpecError):  # load_into's own line: its reason, in parentheses at its end
        detail = detail.partition(" do not fit this model (")[2].removesuffix(")") or detail
    holds = f"the weights of {source.path} do not fit ({detail})"
    now, trained, typed = spec.to_dict(), source.spec, typed_keys(spec.overrides)
    for group in ("model", "dataset"):  # the model's own keys first: they decide its shapes
        if f"{group}." in typed:  # a group choice typed now (model=cnn): the whole option
            option = next((o.partition("=")[2] for o in spec.overrides if o.lstrip("+").partition("=")[0] == group), "")
            was = trained.get(group, {}).get("_target_", "?")
            return (f"{group}: {option} builds a model {holds}; that run was trained with {group} {was}; allowed: the "
                    f"run's own {group} (leave {group}={option} out)")
        for key in sorted(k for k in typed if k.startswith(f"{group}.")):
            value, was = _lookup(now, key), _lookup(trained, key)
            if value != was:
                return (f"{key}: {value} builds a model {holds}; that run was trained with {key}={was}; allowed: "
                        f"{key}={was}, or leave {key} out")
    return f"trainer.resume: the weights of {source.path} do not fit this model ({detail})"


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def tracked(spec, source: Source, verb: str):
    """A new MLflow run (or none, tracking=none) tagged with the run and checkpoint this one used."""
    from runner.tracking.tracker import build_tracker

    Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(spec.run_dir) / "spec.yaml").write_text(spec.to_yaml())
    tracker = build_tracker(spec)
    tracker.start(spec)
    tracker.set_tags({f"runner.{verb}_checkpoint": str(source.path), f"runner.{verb}_run": source.run_id or "",
                      f"runner.{verb}_weights": source.weights.source, "runner.mode": spec.mode})
    return tracker


def check_at_start(spec) -> None:
    """The CLI's check before the run starts: the source exists (a run id is looked up when the run starts,
    as it needs the MLflow store) and predict.input names something to read."""
    from runner.engine.resume_source import check_source

    given = spec.predict.input
    if spec.mode == "predict" and given is not None and not Path(given).exists():
        raise SpecError(f"predict.input: {given!r} does not exist; give a folder of images or a text file with "
                        "one input per line")
    target = spec.trainer.resume
    if not (not Path(target).exists() and _RUN_ID.fullmatch(target)):
        check_source(target, training=False)


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


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree
