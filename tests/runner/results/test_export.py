"""runner/results/export.py: a trained model read back with hydra, safetensors and torch.export alone gives the
trained model's outputs exactly (CPU, fp32)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hydra.utils
import pytest
import safetensors.torch
import torch
import yaml

from runner.results import export
from runner.engine.engine import Engine
from runner.specs.run import SpecError
from tests.conftest import compose_spec

SHORT = ["trainer.max_steps=1", "trainer.progress_bar=off", "trainer.eval_every_epoch=false"]
MLP = ["model=mlp", "model.hidden=[16]", "dataset=synthetic", "dataset.shape=[1,4,4]", "dataset.size=80",
       "dataset.batch_size=8", *SHORT]
GPT = ["dataset=synthetic_tokens", "dataset.vocab_size=64", "dataset.block_size=16", "dataset.size=40",
       "dataset.batch_size=4", "model=gpt", "model.n_embd=32", "model.n_head=2", "task=language_modeling", *SHORT]


def trained(tmp_path_factory: pytest.TempPathFactory, overrides: list[str]) -> tuple[Path, torch.nn.Module]:
    run_dir = tmp_path_factory.mktemp("export") / "run"
    engine = Engine(compose_spec(overrides, run_dir))
    engine.fit()
    return run_dir, engine.module.eval()


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return trained(tmp_path_factory, MLP)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return trained(tmp_path_factory, GPT)


def rebuilt(directory: Path) -> torch.nn.Module:
    """What model.yaml's how-to-load says, with no runner code: hydra builds `_target_`, safetensors fills it."""
    model = hydra.utils.instantiate(yaml.safe_load((directory / "model.yaml").read_text())["model"]).eval()
    safetensors.torch.load_model(model, str(directory / "model.safetensors"))
    return model


@torch.no_grad()
def test_an_mlp_run_exported_reloads_both_ways_to_the_trained_models_outputs(mlp_run: tuple, tmp_path: Path) -> None:
    run_dir, model = mlp_run
    spec = compose_spec([*MLP, f"trainer.resume={run_dir}"], tmp_path / "export_run")
    out = export.run(spec)
    assert out == tmp_path / "export_run" / "export"
    assert sorted(p.name for p in out.iterdir()) == ["example_inputs.safetensors", "model.pt2", "model.safetensors",
                                                     "model.yaml"]
    record = yaml.safe_load((out / "model.yaml").read_text())
    assert record["model"]["input_shape"] == [1, 4, 4] and record["model"]["num_classes"] == 10
    assert record["source"]["step"] == 1 and record["torch_export"] == "model.pt2"
    inputs = safetensors.torch.load_file(str(out / "example_inputs.safetensors"))
    assert list(inputs) == ["input"] and inputs["input"].shape == (8, 1, 4, 4)
    expected = model(**inputs)
    assert torch.equal(rebuilt(out)(**inputs), expected)
    program = torch.export.load(str(out / "model.pt2")).module()
    assert torch.equal(program(**inputs), expected)
    # the program's batch size is free: three samples give what the trained model gives for them
    assert torch.equal(program(input=inputs["input"][:3]), model(inputs["input"][:3]))


@torch.no_grad()
def test_a_gpt_with_tied_weights_exported_reloads_to_the_trained_models_outputs(gpt_run: tuple, tmp_path: Path) -> None:
    run_dir, model = gpt_run
    # the checkpoint file itself (not its run directory) is a source too
    out = export.export_checkpoint(run_dir / "checkpoints" / "last.pt", tmp_path / "out", program=False)
    record = yaml.safe_load((out / "model.yaml").read_text())
    assert (record["model"]["vocab_size"], record["model"]["max_length"]) == (64, 16)
    assert record["torch_export"] == "not asked for" and not (out / "model.pt2").exists()
    inputs = safetensors.torch.load_file(str(out / "example_inputs.safetensors"))
    assert list(inputs) == ["input_ids"] and inputs["input_ids"].dtype == torch.int64
    loaded = rebuilt(out)
    assert loaded.lm_head.weight is loaded.wte.weight  # stored once, tied again on load
    assert torch.equal(loaded(**inputs), model(**inputs))
    assert torch.equal(export.load_exported(out)(**inputs), model(**inputs))  # runner's one-call loader: the same


def test_a_model_torch_export_cannot_trace_is_said_in_one_line_and_the_rest_is_written(
        gpt_run: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError("data-dependent control flow\nmore lines of trace")

    monkeypatch.setattr(torch.export, "export", refuse)
    out = export.export_checkpoint(gpt_run[0], tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["example_inputs.safetensors", "model.safetensors", "model.yaml"]
    reason = "RuntimeError: data-dependent control flow"
    assert yaml.safe_load((out / "model.yaml").read_text())["torch_export"] == f"not written: {reason}"
    said = [r.getMessage() for r in caplog.records if r.name == "runner.results.export" and r.levelname == "WARNING"]
    assert said == [f"export: runner.models.gpt.GPT could not be exported as a torch.export program ({reason}); "
                    "model.safetensors and model.yaml are written"]


@pytest.mark.slow  # the fast test above keeps the safetensors path of gpt; the mlp test keeps torch.export
@torch.no_grad()
def test_a_gpt_exports_as_a_torch_export_program(gpt_run: tuple, tmp_path: Path) -> None:
    run_dir, model = gpt_run
    out = export.export_checkpoint(run_dir, tmp_path / "out")
    inputs = safetensors.torch.load_file(str(out / "example_inputs.safetensors"))
    assert torch.equal(torch.export.load(str(out / "model.pt2")).module()(**inputs), model(**inputs))


@pytest.mark.slow  # the mlp test above keeps the loading code; this proves it imports nothing of runner's engine
def test_the_export_loads_in_a_process_that_never_imports_runners_engine(mlp_run: tuple, tmp_path: Path) -> None:
    out = export.export_checkpoint(mlp_run[0], tmp_path / "out")
    code = f"""
import sys, yaml, torch, hydra.utils, safetensors.torch
d = {str(out)!r}
model = hydra.utils.instantiate(yaml.safe_load(open(d + "/model.yaml"))["model"]).eval()
safetensors.torch.load_model(model, d + "/model.safetensors")
inputs = safetensors.torch.load_file(d + "/example_inputs.safetensors")
with torch.no_grad():
    a, b = model(**inputs), torch.export.load(d + "/model.pt2").module()(**inputs)
safetensors.torch.save_file({{"a": a, "b": b}}, d + "/outputs.safetensors")
print(sorted(m for m in sys.modules if m.startswith("runner") and not m.startswith("runner.models")))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['runner']"  # the package itself, empty: the models' namespace
    outputs = safetensors.torch.load_file(str(out / "outputs.safetensors"))
    inputs = safetensors.torch.load_file(str(out / "example_inputs.safetensors"))
    with torch.no_grad():
        expected = mlp_run[1](**inputs)
    assert torch.equal(outputs["a"], expected) and torch.equal(outputs["b"], expected)


@pytest.mark.parametrize("name, content, message", [
    ("missing.pt", None, "error: trainer.resume: '{path}' does not exist; give a checkpoint file or a run directory"),
    ("garbage.pt", b"not a checkpoint", "error: trainer.resume: {path} is not a valid runner checkpoint "
                                        "(no runner checkpoint header: not written by runner.engine.checkpoint.save)"),
])
def test_a_bad_checkpoint_is_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture, name: str,
                                                         content: bytes | None, message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    assert export.main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == message.format(path=path) + "\n"
    assert not (tmp_path / "out").exists()


def test_run_refuses_a_bad_source_before_any_mlflow_run_exists(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    spec = compose_spec([f"trainer.resume={tmp_path / 'missing'}"], tmp_path / "run", f"sqlite:///{db}")
    with pytest.raises(SpecError, match=r"^trainer.resume: '.*missing' does not exist; give a checkpoint file or a run "
                                        r"directory$"):
        export.run(spec)
    assert not db.exists() and not (tmp_path / "run" / "export").exists()
    spec = compose_spec([], tmp_path / "run", f"sqlite:///{db}")
    with pytest.raises(SpecError, match=r"^trainer.resume: null; mode=export exports a trained model: give "
                                        r"trainer.resume=<run dir \| checkpoint>$"):
        export.run(spec)
    assert not db.exists()


def test_run_refuses_a_typed_model_key_the_weights_do_not_fit_before_any_mlflow_run_exists(mlp_run: tuple,
                                                                                          tmp_path: Path) -> None:
    """As eval and predict do: before, export built the trained run's model, ignored model.hidden=[8] and exported
    the [16] model under a command that asked for another."""
    db = tmp_path / "mlflow.db"
    typed = [*(o for o in MLP if o != "model=mlp" and not o.startswith("model.hidden=")), "model.hidden=[8]",
             f"trainer.resume={mlp_run[0]}"]
    spec = compose_spec(typed, tmp_path / "run", f"sqlite:///{db}")
    with pytest.raises(SpecError, match=r"^model.hidden: \[8\] builds a model the weights of .*step-00000001.pt do not "
                                        r"fit \(.*\); that run was trained with model.hidden=\[16\]; allowed: "
                                        r"model.hidden=\[16\], or leave model.hidden out$"):
        export.run(spec)
    assert not db.exists() and not (tmp_path / "run" / "export").exists()


@pytest.mark.slow  # MLflow's start-up; the mlp test keeps what is written, this what reaches MLflow
def test_run_logs_the_export_as_artifacts_of_a_finished_run_tagged_with_its_source(mlp_run: tuple, tmp_path: Path) -> None:
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = export.run(compose_spec([f"trainer.resume={mlp_run[0]}"], tmp_path / "run", uri))
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["runner.exported_from_checkpoint"] == str(mlp_run[0] / "checkpoints" / "step-00000001.pt")
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "export")}
    assert logged == {f"export/{p.name}" for p in out.iterdir()}
    copy = Path(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="export",
                                                    dst_path=str(tmp_path / "dl"), tracking_uri=uri))
    inputs = safetensors.torch.load_file(str(copy / "example_inputs.safetensors"))
    with torch.no_grad():
        assert torch.equal(rebuilt(copy)(**inputs), mlp_run[1](**inputs))


def _holds(directory: Path, name: str) -> bool:
    """Whether a file `name` is under directory yet. The directory may come and go first: preflight makes it
    and removes it again (its write probe) before Hydra makes it for the run."""
    try:
        return any(f.name == name for f in directory.rglob("*"))
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum", [9, 15])
def test_an_export_killed_while_writing_leaves_no_partial_export_and_a_sigterm_ends_its_mlflow_run_killed(
        tmp_path: Path, gpt_run: tuple, store: str, signum: int) -> None:
    """A real kill of `python -m runner mode=export` once its first file is on disk: before, export/ held
    model.safetensors without model.yaml (SIGKILL) and the MLflow run ended FAILED (SIGTERM)."""
    import os
    import signal
    import time

    from mlflow.tracking import MlflowClient

    run_dir, _ = gpt_run
    out_dir = tmp_path / "exp"
    proc = subprocess.Popen([sys.executable, "-m", "runner", "mode=export", f"trainer.resume={run_dir}",
                             f"hydra.run.dir={out_dir}", f"tracking.uri={store}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if _holds(out_dir, "model.safetensors"):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the export ended before its first file could be seen"
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (-9 if signum == 9 else 128 + 15), err[-2000:]
    export_dir = out_dir / "export"
    assert not export_dir.exists() or (export_dir / "model.yaml").exists()
    if signum == 15:
        assert err.strip().splitlines()[-1] == "runner: stopped by SIGTERM; the run was marked KILLED"
        [exported] = MlflowClient(store).search_runs(MlflowClient(store).search_experiments()[0].experiment_id.split())
        assert exported.info.status == "KILLED"
        assert not list(out_dir.glob(".export.tmp-*"))  # the half-written files are removed too
