"""tracking.log_model=best|last|none (runner/addons/mlflow_model.py): the run's model as an MLflow model, loaded back
with mlflow.pytorch.load_model (by the run, and by the registry after mlflow.register_model) to the outputs
of the runner's own model at those weights."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import mlflow
import mlflow.pytorch
import pytest
import torch
from mlflow import MlflowClient

from runner.engine.components import build_model
from runner.specs import components
from runner.engine.run_data import build_data

from runner.engine import checkpoint
from runner.results import export

from runner.addons import mlflow_model
from runner.engine.engine import Engine
from runner.tracking.tracker import build_tracker
from tests.conftest import compose_spec, run_cli

# val/acc minimized: the best validation is step 2's (accuracy rises), the last step is 4
TINY = ["model.hidden=[16]", "dataset.batch_size=256", "trainer.progress_bar=off", "trainer.eval_every_epoch=false",
        "trainer.max_steps=4", "trainer.eval_every_n_steps=2", "task._target_=tests.user_pkg.training.LowAccuracyFirst",
        "trainer.memory_estimate=false"]
# pt2 programs and the eager model run the same ATen kernels on the CPU: equal to float rounding at most
ATOL, RTOL = 1e-6, 1e-5


def tracked_run(tmp_path: Path, store: str, which: str, *extra: str) -> tuple[Engine, str]:
    spec = compose_spec([*TINY, f"tracking.log_model={which}", *extra], tmp_path / f"run_{which}", store)
    engine = Engine(spec, build_tracker(spec))
    engine.fit()
    return engine, engine.tracker.run_id


def outputs_at(engine: Engine, weights: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """The runner's own model (the engine's module) with `weights`, on `inputs`."""
    module = engine.module
    kept = {k: v.clone() for k, v in module.state_dict().items()}
    module.load_state_dict(weights)
    module.eval()
    with torch.no_grad():
        out = module(inputs)
    module.load_state_dict(kept)
    return out


def logged_models(store: str, run_id: str) -> list:
    return MlflowClient(store).get_run(run_id).outputs.model_outputs


def val_inputs(engine: Engine) -> torch.Tensor:
    return next(iter(engine.eval_loaders["val"]))[0][:32]


def test_best_weights_logged_load_back_by_run_and_registry_to_the_runners_outputs(tmp_path: Path, store: str) -> None:
    engine, run_id = tracked_run(tmp_path, store, "best")
    assert engine.best_weights.source == "best@step 2"
    [output] = logged_models(store, run_id)  # the run page's "Logged models"
    assert output.step == 2
    client = MlflowClient(store)
    model = client.get_logged_model(output.model_id)
    assert model.name == "model" and str(model.status).endswith("READY")
    assert model.tags["runner.weights_from"] == "best@step 2" and model.tags["runner.step"] == "2"
    assert model.tags["runner.serialization"] == "pt2"
    assert client.get_run(run_id).data.tags["runner.logged_model"] == f"models:/{output.model_id} (best@step 2)"
    # the metrics of step 2 (its validation) are linked to the model
    assert {m.key for m in model.metrics} >= {"val/acc", "val/loss"} and {m.step for m in model.metrics} == {2}

    best = checkpoint.load(tmp_path / "run_best" / "checkpoints" / "best-step-00000002.pt")["model"]  # a runner checkpoint
    inputs = val_inputs(engine)
    expected = outputs_at(engine, best, inputs)
    assert not torch.allclose(expected, outputs_at(engine, engine.module.state_dict(), inputs))  # step 4's differ

    mlflow.set_tracking_uri(store)
    try:
        by_run = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
        torch.testing.assert_close(by_run(inputs), expected, atol=ATOL, rtol=RTOL)
        version = mlflow.register_model(f"models:/{output.model_id}", "digits-mlp")
        assert version.version == 1
        by_registry = mlflow.pytorch.load_model("models:/digits-mlp/1")
        torch.testing.assert_close(by_registry(inputs), expected, atol=ATOL, rtol=RTOL)
        info = mlflow.models.get_model_info(f"models:/{output.model_id}")
        requirements = Path(mlflow.pyfunc.get_model_dependencies(f"models:/{output.model_id}")).read_text()
    finally:
        mlflow.set_tracking_uri(None)
    assert info.signature.inputs.to_dict()[0]["tensor-spec"] == {"dtype": "float32", "shape": (-1, 1, 8, 8)}
    assert info.signature.outputs.to_dict()[0]["tensor-spec"] == {"dtype": "float32", "shape": (-1, 10)}
    # given, not inferred: torch at the running version (without a local build label such as +cu130)
    assert f"torch=={torch.__version__.split('+')[0]}" in requirements.split()

    # last: the final weights (step 4), through the same logger with tracking.log_model=last, on this run
    # (a second tracked run would cost seconds; test_fsdp_logs_the_last_weights_once_from_rank_0 runs one)
    tracking = dataclasses.replace(engine.spec.tracking, log_model="last")
    last = mlflow_model.ModelLogger(dataclasses.replace(engine.spec, tracking=tracking), engine.view, engine.logged_model.data,
                                    engine.best_weights)
    last.log()
    model = client.get_logged_model(last.model_uri.removeprefix("models:/"))
    assert model.tags["runner.weights_from"] == "last@step 4" and model.tags["runner.step"] == "4"
    mlflow.set_tracking_uri(store)
    try:
        loaded = mlflow.pytorch.load_model(last.model_uri)
    finally:
        mlflow.set_tracking_uri(None)
    torch.testing.assert_close(loaded(inputs), outputs_at(engine, engine.module.state_dict(), inputs), atol=ATOL, rtol=RTOL)


def test_none_logs_no_model(tmp_path: Path, store: str) -> None:
    _, run_id = tracked_run(tmp_path, store, "none", "trainer.max_steps=1")
    assert logged_models(store, run_id) == []
    assert "runner.logged_model" not in MlflowClient(store).get_run(run_id).data.tags
    assert MlflowClient(store).search_logged_models(experiment_ids=["0", "1"]) == []


# slow (two ranks through torchrun, ~15 s): in CI, test_best_weights_logged_... keeps what is logged and how it
# loads back, and test_two_ranks_... (test_parallel.py) that fsdp's final weights equal one process's
@pytest.mark.slow
def test_fsdp_logs_the_last_weights_once_from_rank_0(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    # the last weights: the ranking task of TINY (importable from the checkout only) is not needed here
    proc = run_cli([*(o for o in TINY if not o.startswith("task.")), "tracking.log_model=last", "parallelism=fsdp", "parallelism.nproc_per_node=2",
                    "dataset.batch_size=64", f"hydra.run.dir={tmp_path / 'run'}", f"tracking.uri=sqlite:///{db}",
                    f"tracking.artifact_root={tmp_path / 'artifacts'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("MLflow model 'model' logged: last@step 4 weights") == 1, proc.stdout
    client = MlflowClient(f"sqlite:///{db}")
    [run] = client.search_runs(["1"])
    [output] = run.outputs.model_outputs
    assert output.step == 4
    # the runner's own model at the final weights: rebuilt from the run's last checkpoint by mode=export's code
    final = export.load_exported(export.export_checkpoint(tmp_path / "run", tmp_path / "export", program=False,
                                                          which="last"))  # a run directory: its tested weights by default
    inputs = torch.randn(16, 1, 8, 8)
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    try:
        loaded = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    finally:
        mlflow.set_tracking_uri(None)
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs), final(inputs), atol=ATOL, rtol=RTOL)


def test_tracking_off_logs_no_model_and_the_run_finishes(tmp_path: Path) -> None:
    spec = compose_spec([*TINY, "trainer.max_steps=1", "tracking.log_model=best"], tmp_path / "run")  # tracking=none
    engine = Engine(spec)
    result = engine.fit()
    assert result.steps == 1 and engine.logged_model.model_uri is None
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "artifacts").exists()


# slow (transformers, ~20 s on a loaded machine): the single-input path is in CI (test_best_weights_logged_...)
@pytest.mark.slow
def test_a_huggingface_model_of_named_inputs_is_logged_pickled_and_loads_back(tmp_path: Path, store: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Named inputs (input_ids, attention_mask): MLflow's pt2 takes positional tensors only, so the model is
    pickled; the signature names each input, and the loaded model gives the same logits."""
    pytest.importorskip("transformers")
    from tests.models.test_hf import write_reviews

    spec = compose_spec(["model=hf", "+model.config={dim: 32, n_layers: 1, n_heads: 2, hidden_dim: 64}",
                         "dataset=text_classification", f"dataset.train_file={write_reviews(tmp_path / 'reviews.csv')}",
                         f"dataset.root={tmp_path / 'datasets'}", "dataset.max_length=32", "tracking.log_model=last"],
                        tmp_path / "run", store)
    spec = components.resolved_spec(spec)
    data = build_data(spec)
    model = build_model(spec, data).eval()
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("hf", artifact_location=str(tmp_path / "art"))).info.run_id
    info, serialization = mlflow_model.log_model(spec, data, model.state_dict(), run_id, "last@step 0", 0)
    assert serialization == "pickle"
    assert info.signature.inputs.input_names() == ["input_ids", "attention_mask"]
    assert client.get_logged_model(info.model_id).tags["runner.serialization"] == "pickle"
    inputs = {k: v[:3] for k, v in export.example_inputs(spec, data, model).items()}
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # what loading a pickled model asks for
    mlflow.set_tracking_uri(store)
    try:
        loaded = mlflow.pytorch.load_model(info.model_uri)
    finally:
        mlflow.set_tracking_uri(None)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


def test_an_ema_objective_logs_the_ema_weights_it_measured(tmp_path: Path, store: str) -> None:
    """Defect: with objective.metric=val/ema/acc the logged model held the raw weights, not the EMA weights
    whose validation the run reported as its best."""
    spec = compose_spec([*[o for o in TINY if not o.startswith("objective.")], "tracking.log_model=best",
                         "trainer.ema.decay=0.9", "objective.metric=val/ema/acc"], tmp_path / "run", store)
    engine = Engine(spec, build_tracker(spec))
    engine.fit()
    source = engine.best_weights.source
    step = int(source.rpartition(" ")[2])
    kept = checkpoint.load(tmp_path / "run" / "checkpoints" / f"best-step-{step:08d}.pt")  # the tested weights
    ema, raw = kept["averages"]["ema"]["values"], kept["model"]
    assert not all(torch.equal(ema[k], raw[k]) for k in ema)  # the EMA differs from the raw weights
    mlflow.set_tracking_uri(store)
    try:
        loaded = mlflow.pytorch.load_model(f"runs:/{engine.tracker.run_id}/model")
    finally:
        mlflow.set_tracking_uri(None)
    logged = loaded.state_dict()
    assert logged.keys() == raw.keys() and all(torch.equal(logged[k], ema[k]) for k in raw)
    inputs = val_inputs(engine)
    torch.testing.assert_close(loaded(inputs), outputs_at(engine, ema, inputs), atol=ATOL, rtol=RTOL)
    model = MlflowClient(store).get_logged_model(logged_models(store, engine.tracker.run_id)[0].model_id)
    assert model.tags["runner.weights_from"] == f"{source} (ema)"
