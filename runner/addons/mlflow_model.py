"""`tracking.log_model=best|last`: the run's model as an MLflow model (mlflow.pytorch), where MLflow users
look for it: the run page's "Logged models", `mlflow.register_model`, `mlflow.pytorch.load_model`.

best: the weights the test metrics came from (trainer.test_on=best: the best value of objective.metric;
where no best weights were kept, the last ones, and the tags say so); last: the final weights. Of those,
the raw weights or an average (`weights.average`; by default the one objective.metric measures: with
val/ema/acc the EMA weights are what leaves the run), chosen by runner/engine/run_weights.py. The model
is the one `model._target_` builds, freshly built on the CPU in fp32 and given those weights, so what is
pickled is the user's own class: no DDP/FSDP/compile wrapper, no activation-checkpointing mixin. Loading
it back needs that class importable (runner installed for the built-in runner.models; a user's own
package on the path), as for any pickled torch module; its `_target_` is in the model's tags.

Every rank calls `log`; rank 0 alone reads the weights, whole, from the run's checkpoint that holds them
(the final one, or the kept best) and logs. With trainer.save_checkpoints=false no checkpoint holds them: the
module's are gathered as whole tensors (a collective under fsdp). pip requirements are given (torch and the model libraries loaded, pinned to the running
versions): MLflow would otherwise spend seconds inferring them by loading the model in a subprocess.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from runner.addons.base import AddOn, EngineView
from runner.engine import components

from runner.engine import checkpoint, parallel, run_weights

log = logging.getLogger(__name__)

NAME = "model"         # runs:/<run id>/model, as mlflow.pytorch's own examples name it
KEPT_DIR = "mlflow_model"  # in the run directory: the model saved while the store could not be reached
EXAMPLE_ROWS = 2       # samples of a validation batch kept as the input example (its JSON is stored)
_MODEL_LIBRARIES = ("torchvision", "timm", "transformers")  # pinned too where the run loaded them


class ModelLogger(AddOn):
    """An add-on (runner/addons/base.py): logs at the end of a finished run. `data` is the run's data (the
    input example), `best_weights` the run's BestWeights (which weights the test used)."""

    name = "model_logging"

    def __init__(self, spec: Any, view: EngineView, data: Any, best_weights: Any):
        self.which = "none" if spec.tracking.name == "none" else spec.tracking.log_model
        self.spec, self.view, self.data, self.best_weights = spec, view, data, best_weights
        self.model_uri: str | None = None  # models:/<model id> once logged

    def on_run_end(self, final: dict[str, float]) -> None:
        self.log()

    def log(self) -> None:
        """At the end of training, after the test: every rank calls it (the same decision on each)."""
        if self.which == "none":
            return
        view = self.view
        tested = self.best_weights.source if self.which == "best" else f"last@step {view.progress.step}"
        which, _, step = tested.partition("@step ")
        step, average = int(step), run_weights.chosen_average(self.spec)
        if step == view.progress.step and not self.spec.trainer.save_checkpoints:
            # no checkpoint holds these weights: the module's, as whole tensors (fsdp: every rank gathers)
            state = {"model": parallel.full_model_state(view.module), "averages": self.best_weights.averages.whole_state()}
        elif step == view.progress.step:  # the final checkpoint (just written) holds them: read on the main rank only
            state = _read(Path(self.spec.run_dir) / "checkpoints" / f"step-{step:08d}.pt") if view.env.is_main else None
        else:  # a kept best checkpoint, read on the main rank only
            state = self.best_weights.saved_state(step) if view.env.is_main else None
        if not view.env.is_main or view.tracker.run_id is None:
            return
        if state is None:
            view.say(f"tracking.log_model={self.which}: the weights of step {step} cannot be read; "
                     "no model logged")
            return
        weights = run_weights.RunWeights(Path(self.spec.run_dir), which, step, average, state)
        state, source = weights.state_dict(), weights.source
        started = time.perf_counter()
        # the metrics of that step stored first: MLflow links them to the model
        info, unreachable = None, not view.tracker.flush() or getattr(view.tracker, "unreachable", False)
        if not unreachable:
            try:
                info, serialization = log_model(self.spec, self.data, state, view.tracker.run_id, source, step)
            except Exception as e:
                from runner.tracking.writer import refused

                if refused(e):
                    raise
                unreachable = True  # past MLflow's own retries: kept, as below
        if info is not None:
            self.model_uri = info.model_uri
            view.tracker.set_tags({"runner.logged_model": f"{info.model_uri} ({source})"})
            view.say(f"MLflow model '{NAME}' logged: {source} weights, {info.model_uri} ({_how(self.spec, serialization)}; "
                     f"{time.perf_counter() - started:.2f} s)")
            return
        # the store cannot be reached: the model is saved in the run directory, and the tracker logs it to the
        # run when the store answers (now, on resume, or at the next opening of the store)
        kept = Path(self.spec.run_dir) / KEPT_DIR
        serialization = save_model(self.spec, self.data, state, kept)
        view.tracker.log_saved_model(kept, NAME, step, {**model_tags(self.spec, source, step),
                                                        "runner.serialization": serialization}, source)
        view.say(f"MLflow model '{NAME}' kept in {kept}: {source} weights ({_how(self.spec, serialization)}); the "
                 "store cannot be reached, and it is logged to the run once the store answers")


def _how(spec: Any, serialization: str) -> str:
    return ("a torch.export program" if serialization == "pt2" else f"pickled: loading it needs {spec.model.target} "
            "importable and MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true")


def model_tags(spec: Any, source: str, step: int) -> dict[str, str]:
    return {"runner.weights_from": source, "runner.step": str(step), "runner.model_target": spec.model.target}


def log_model(spec: Any, data: Any, state: dict, run_id: str, source: str, step: int) -> tuple[Any, str]:
    """The model `spec` builds, with `state`, logged to MLflow run `run_id`; returns MLflow's ModelInfo and
    the serialization (pt2 or pickle).

    As a torch.export program (MLflow's pt2: loads with no model code and no pickle) where the model takes
    one tensor and exports; pickled otherwise (several named inputs, or a model torch.export cannot trace),
    which loading needs the model's class importable and MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true for."""
    import mlflow
    import mlflow.pytorch

    model = _rebuilt(spec, data, state)
    inputs, signature = _example(spec, data, model)
    tags = model_tags(spec, source, step)
    formats = ["pt2", "pickle"] if not isinstance(inputs, dict) else ["pickle"]  # pt2 takes positional tensors only
    with _run_store(spec.tracking.uri, run_id):
        for i, serialization in enumerate(formats):
            # pt2: MLflow would trace it a second time to check its serving input. pickle: that check would
            # only fail (pyfunc refuses pickles and dict inputs by default), and the option reaches torch.save
            options = {"validate_serving_input": False} if serialization == "pt2" else {}
            try:
                with _quiet("mlflow", logging.WARNING if serialization == "pt2" else logging.ERROR):
                    return mlflow.pytorch.log_model(
                        model, name=NAME, run_id=run_id, step=step, signature=signature, input_example=inputs,
                        pip_requirements=pip_requirements(spec.model.target), serialization_format=serialization,
                        tags={**tags, "runner.serialization": serialization}, **options), serialization
            except Exception as e:
                if i == len(formats) - 1 or _store_error(e):
                    raise
                log.warning("tracking.log_model: %s does not export as a torch.export program (%s: %s); "
                            "logging it pickled", spec.model.target, type(e).__name__,
                            (str(e).strip().splitlines() or [""])[0][:200])
                _drop_failed(mlflow.last_logged_model(), run_id)


def save_model(spec: Any, data: Any, state: dict, path: Path) -> str:
    """The model log_model logs, saved to the folder `path` instead (mlflow.pytorch.save_model: the same
    files, no store needed); returns the serialization."""
    import shutil

    import mlflow.pytorch

    model = _rebuilt(spec, data, state)
    inputs, signature = _example(spec, data, model)
    formats = ["pt2", "pickle"] if not isinstance(inputs, dict) else ["pickle"]
    for i, serialization in enumerate(formats):
        shutil.rmtree(path, ignore_errors=True)  # save_model refuses an existing folder (a resumed run's)
        try:
            with _quiet("mlflow", logging.WARNING if serialization == "pt2" else logging.ERROR):
                mlflow.pytorch.save_model(model, str(path), signature=signature, input_example=inputs,
                                          pip_requirements=pip_requirements(spec.model.target),
                                          serialization_format=serialization)
            return serialization
        except Exception as e:
            if i == len(formats) - 1:
                raise
            log.warning("tracking.log_model: %s does not export as a torch.export program (%s: %s); "
                        "saving it pickled", spec.model.target, type(e).__name__,
                        (str(e).strip().splitlines() or [""])[0][:200])
    raise AssertionError("unreachable")


def _store_error(error: BaseException) -> bool:
    """A store that did not answer, rather than a model torch.export cannot trace."""
    # MLflow's REST client raises "API request to <url> failed ..." once its retries are spent
    return isinstance(error, (ConnectionError, TimeoutError)) or "API request to" in str(error)


def _drop_failed(model: Any, run_id: str) -> None:
    """MLflow keeps a model whose logging failed (status FAILED) beside the one that follows: removed."""
    if model is not None and model.source_run_id == run_id and str(model.status).endswith("FAILED"):
        from mlflow import MlflowClient

        MlflowClient().delete_logged_model(model.model_id)


def _rebuilt(spec: Any, data: Any, state: dict) -> torch.nn.Module:
    """A fresh model from `_target_` with those weights; its initialisation draws from a forked CPU RNG,
    so the run's random streams (saved in its final checkpoint) are as if it were never built."""
    with torch.random.fork_rng(devices=[]):
        model = components.build_model(spec, data)
    model.load_state_dict(state)
    return model.float().eval()


def _example(spec: Any, data: Any, model: torch.nn.Module) -> tuple[Any, Any]:
    """The first samples of a validation batch (a dict by argument name where the model takes several,
    as a HF model does) and the signature inferred from them and the model's outputs."""
    from mlflow.models import infer_signature

    from runner.tasks.batches import example_inputs

    batch = {k: v[:EXAMPLE_ROWS] for k, v in example_inputs(spec, data, model).items()}
    with torch.no_grad():
        outputs = _numpy_outputs(model(**batch))
    inputs = {k: v.numpy() for k, v in batch.items()}
    inputs = next(iter(inputs.values())) if len(inputs) == 1 else inputs  # one tensor: what pyfunc feeds it
    return inputs, infer_signature(inputs, outputs)


def _numpy_outputs(outputs: Any) -> Any:
    """A tensor, or the tensors of a mapping (a HF ModelOutput); None where the outputs are neither."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float().numpy()
    if isinstance(outputs, dict):
        return {k: v.float().numpy() for k, v in outputs.items() if isinstance(v, torch.Tensor)} or None
    return None


def pip_requirements(target: str) -> list[str]:
    """torch, and the model libraries this process loaded, at their running versions (a local build label
    such as +cu130 dropped: pip cannot resolve it from PyPI); the model's own distribution where installed."""
    names = ["torch", *(n for n in _MODEL_LIBRARIES if n in sys.modules)]
    top = target.split(".")[0]
    if top not in ("runner", *names):  # runner is not on PyPI; a user's installed package is pinned like torch
        with contextlib.suppress(Exception):
            names += importlib.metadata.packages_distributions().get(top, [])[:1]
    pins = []
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            pins.append(f"{name}=={importlib.metadata.version(name).split('+')[0]}")
    return pins


@contextlib.contextmanager
def _run_store(uri: str, run_id: str):
    """mlflow.pytorch.log_model writes through MLflow's process-wide store and, with no active run, files the
    model under the default experiment: pointed at the run's store and experiment for the call, then back
    (the MLFLOW_TRACKING_URI it sets for subprocesses too). No active run is started: ending one would end
    the tracker's run."""
    import mlflow
    from mlflow.tracking import is_tracking_uri_set

    before = mlflow.get_tracking_uri() if is_tracking_uri_set() else None
    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    mlflow.set_tracking_uri(uri)
    os.environ["MLFLOW_EXPERIMENT_ID"] = mlflow.MlflowClient(uri).get_run(run_id).info.experiment_id
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet(name: str, level: int):
    """MLflow's lines about the model it logs below `level` (the run's own line says what was logged)."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(max(before, level))
    try:
        yield
    finally:
        logger.setLevel(before)


def _read(path: Path) -> dict | None:
    try:
        return checkpoint.load_weights(path)
    except Exception as e:  # the caller says that no model is logged
        log.warning("cannot read %s (%s)", path, (str(e).strip() or type(e).__name__).splitlines()[0])
        return None

