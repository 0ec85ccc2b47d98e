"""runner/results/modes.py, runner/results/predict.py, runner/results/source.py: `mode=eval|predict` on a trained run's checkpoint,
named by its run directory, a checkpoint file or its MLflow run id. In-process (launch.run), tiny runs."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from runner.engine import checkpoint

from runner.engine.components import build_model
from runner.specs import components
from runner.engine.run_data import build_data
from runner.cli.launch import run
from runner.tasks.language_modeling import generate
from runner.results.source import resolve_source
from runner.specs.run import SpecError
from runner.tracking.tracker import RUN_FILE
from tests.conftest import compose_spec

# three optimizer steps of an epoch of ~20: one validation, at the end, so the best weights are the last
TRAIN = ["trainer.max_steps=3", "trainer.progress_bar=off", "trainer.memory_estimate=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, migrated_mlflow_store: Path) -> tuple[Path, str]:
    return trained_run(tmp_path_factory, migrated_mlflow_store, "modes", TRAIN)


def trained_run(factory: pytest.TempPathFactory, store: Path, name: str, overrides: list[str]) -> tuple[Path, str]:
    """A run of `overrides` trained into its own copy of the session's MLflow store: its directory and store URI."""
    root = factory.mktemp(name)
    shutil.copy(store, root / "mlflow.db")
    uri = f"sqlite:///{root}/mlflow.db"
    run(compose_spec(overrides, root / "src", uri))
    return root / "src", uri


def logged(uri: str, run_id: str) -> dict[str, float]:
    return MlflowClient(uri).get_run(run_id).data.metrics


def test_the_source_is_the_same_by_run_dir_checkpoint_file_and_mlflow_run_id(trained: tuple, tmp_path: Path) -> None:
    src, uri = trained
    source_run = (src / RUN_FILE).read_text().strip()
    last = checkpoint.verify(src)
    found = [resolve_source(compose_spec(["mode=eval", f"trainer.resume={target}"], tmp_path / "eval", uri))
             for target in (src, last, source_run)]
    assert [f[0] for f in found] == [last] * 3
    assert [f[2] for f in found] == [source_run] * 3
    assert all(f[1] == yaml.safe_load((src / "spec.yaml").read_text()) for f in found)


def test_eval_gives_the_source_runs_logged_metrics_in_a_new_tagged_run(trained: tuple, tmp_path: Path) -> None:
    src, uri = trained
    source_run = (src / RUN_FILE).read_text().strip()
    result = run(compose_spec(["mode=eval", f"trainer.resume={source_run}"], tmp_path / "eval", uri))
    source = logged(uri, source_run)
    expected = {k: v for k, v in source.items() if k.startswith(("val/", "test/"))}
    assert {"val/acc", "test/acc", "test/loss"} <= expected.keys()
    assert result.final == expected  # exactly: the same weights through the same Engine.evaluate
    new_run = (tmp_path / "eval" / RUN_FILE).read_text().strip()
    assert new_run != source_run
    got = MlflowClient(uri).get_run(new_run)
    assert got.info.status == "FINISHED"
    assert got.data.metrics == expected
    assert got.data.tags["runner.evaluated_run"] == source_run
    assert got.data.tags["runner.evaluated_checkpoint"] == str(checkpoint.verify(src))


def test_eval_on_chosen_splits_of_other_data_given_on_the_command_line(trained: tuple, tmp_path: Path) -> None:
    src, _ = trained
    same = yaml.safe_load((src / "result.yaml").read_text())  # the source run's own test metrics
    other = run(compose_spec(["mode=eval", f"trainer.resume={src}", "eval.splits=[test]", "dataset.split_seed=1"],
                             tmp_path / "other"))
    assert sorted(other.final) == ["test/acc", "test/loss", "test/top5"]
    assert other.final["test/loss"] != same["final"]["test/loss"]  # another test split: the typed key reached the data
    assert yaml.safe_load((tmp_path / "other" / "spec.yaml").read_text())["dataset"]["split_seed"] == 1


def test_predict_on_the_test_split_is_the_argmax_of_the_models_forward(trained: tuple, tmp_path: Path) -> None:
    src, _ = trained
    spec = compose_spec(["mode=predict", f"trainer.resume={src}"], tmp_path / "pred")
    run(spec)
    rows = list(csv.DictReader((tmp_path / "pred" / "predictions.csv").open()))
    # by hand: the model built from the spec, the checkpoint's weights, one forward over the whole split
    data = build_data(spec)
    model = build_model(components.resolved_spec(spec), data)
    model.load_state_dict(checkpoint.load(checkpoint.verify(src))["model"])
    model.eval()
    x, y = zip(*[data.test[i] for i in range(len(data.test))])
    with torch.no_grad():
        probs = torch.softmax(model(torch.stack(x)), dim=-1)
    assert len(rows) == len(data.test)
    assert [int(r["predicted"]) for r in rows] == probs.argmax(-1).tolist()
    assert [int(r["label"]) for r in rows] == [int(v) for v in y]
    assert [int(r["id"]) for r in rows] == list(range(len(rows)))
    torch.testing.assert_close(torch.tensor([[float(r[f"p_{c}"]) for c in range(10)] for r in rows]), probs,
                               atol=1e-6, rtol=0)


GPT = ["task=language_modeling", "dataset=synthetic_tokens", "dataset.vocab_size=64", "dataset.block_size=16",
       "dataset.size=64", "dataset.batch_size=8", "model=gpt", "model.size=tiny", "objective.metric=val/loss",
       "objective.direction=minimize", "trainer.max_steps=1", "trainer.progress_bar=off", "trainer.memory_estimate=false"]


def test_predict_for_a_language_model_at_temperature_0_is_the_greedy_continuation(tmp_path: Path) -> None:
    run(compose_spec(GPT, tmp_path / "gpt"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n40 5\n")
    spec = compose_spec(["mode=predict", f"trainer.resume={tmp_path / 'gpt'}", f"predict.input={prompts}",
                         "predict.format=jsonl", "predict.max_new_tokens=5", "predict.temperature=0"], tmp_path / "pred")
    run(spec)
    rows = [json.loads(line) for line in (tmp_path / "pred" / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 2]  # line numbers; the blank line is no prompt
    source = compose_spec(GPT, tmp_path / "gpt")
    data = build_data(source)
    model = build_model(components.resolved_spec(source), data)
    model.load_state_dict(checkpoint.load(checkpoint.verify(tmp_path / "gpt"))["model"])
    model.eval()
    for row, prompt in zip(rows, ([1, 2, 3], [40, 5])):
        x = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(5):  # the greedy loop by hand
                x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert row["tokens"] == x[0, len(prompt):].tolist()
        assert row["generated"] == " ".join(map(str, row["tokens"]))
    # sampled: the same seed, the same continuation; top_k=1 is greedy
    g = torch.Generator().manual_seed(0)
    assert generate(model, [1, 2, 3], 5, 1.0, 1, g) == rows[0]["tokens"]


@pytest.mark.slow  # CI keeps predict's rows (test_predict_on_the_test_split...) and other data (test_eval_on_chosen_splits...)
def test_a_folder_of_images_is_predicted_and_another_folder_evaluated(tmp_path: Path) -> None:
    from PIL import Image

    gen = torch.Generator().manual_seed(0)

    def image(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(torch.randint(0, 256, (8, 8, 3), generator=gen, dtype=torch.uint8).numpy()).save(path)

    for root in ("imgs", "imgs2"):
        for split in ("train", "val"):
            for c in ("cat", "dog"):
                for i in range(4):
                    image(tmp_path / root / split / c / f"{i}.png")
    for i in range(3):
        image(tmp_path / "new" / f"x{i}.png")
    data = ["dataset=imagefolder", "dataset.batch_size=4"]
    run(compose_spec([*data, f"dataset.root={tmp_path / 'imgs'}", *TRAIN[:1], "trainer.progress_bar=off"], tmp_path / "src"))
    run(compose_spec(["mode=predict", f"trainer.resume={tmp_path / 'src'}", f"predict.input={tmp_path / 'new'}"],
                     tmp_path / "pred"))
    rows = list(csv.DictReader((tmp_path / "pred" / "predictions.csv").open()))
    assert [r["id"] for r in rows] == ["x0.png", "x1.png", "x2.png"]
    assert all(abs(float(r["p_0"]) + float(r["p_1"]) - 1) < 1e-5 for r in rows)
    own = run(compose_spec(["mode=eval", f"trainer.resume={tmp_path / 'src'}"], tmp_path / "own"))
    other = run(compose_spec(["mode=eval", f"trainer.resume={tmp_path / 'src'}", "dataset=imagefolder",
                              f"dataset.root={tmp_path / 'imgs2'}"], tmp_path / "other"))
    assert sorted(other.final) == ["val/acc", "val/loss"] and other.final != own.final
    assert yaml.safe_load((tmp_path / "other" / "spec.yaml").read_text())["dataset"]["batch_size"] == 4  # the source's


def test_export_by_mlflow_run_id_writes_a_model_that_reloads_to_the_same_outputs(trained: tuple, tmp_path: Path) -> None:
    """mode=export through the same dispatch and source resolver as eval (tests/runner/results/test_export.py tests
    what the files hold and that they load without runner)."""
    from runner.results.export import load_exported

    src, uri = trained
    source_run = (src / RUN_FILE).read_text().strip()
    result = run(compose_spec(["mode=export", f"trainer.resume={source_run}"], tmp_path / "exp", uri))
    assert result.steps == 0 and result.final == {}
    out = tmp_path / "exp" / "export"
    assert {"model.safetensors", "model.yaml"} <= {p.name for p in out.iterdir()}
    new_run = (tmp_path / "exp" / RUN_FILE).read_text().strip()
    got = MlflowClient(uri).get_run(new_run)
    assert got.info.status == "FINISHED" and got.data.tags["runner.exported_from_run"] == source_run
    state = checkpoint.load(checkpoint.verify(src))["model"]
    model = load_exported(out).state_dict()
    assert state.keys() == model.keys() and all(torch.equal(model[k], v) for k, v in state.items())


def test_a_text_file_is_predicted_by_a_text_classifier_as_its_val_split_of_the_same_texts(tmp_path: Path) -> None:
    words = ["good fine great", "bad awful poor", "great good", "poor bad", "fine", "awful"]
    train, val = tmp_path / "train.csv", tmp_path / "val.csv"
    train.write_text("text,label\n" + "".join(f"{words[i % 6]} {i},{i % 6 % 2}\n" for i in range(24)))
    texts = ["good great", "awful bad poor", "fine fine", "poor", "great"]
    val.write_text("text,label\n" + "".join(f"{t},{i % 2}\n" for i, t in enumerate(texts)))
    data = ["dataset=text_classification", f"dataset.train_file={train}", f"dataset.val_file={val}",
            f"dataset.root={tmp_path}", "dataset.vocab_size=300", "dataset.batch_size=4", "dataset.test_fraction=0",
            "model=distilbert", "model.config.n_layers=1", "model.config.dim=32", "model.config.n_heads=2",
            "model.config.hidden_dim=64"]
    run(compose_spec([*data, *TRAIN], tmp_path / "src"))
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join([texts[0], "", *texts[1:]]) + "\n")
    run(compose_spec(["mode=predict", f"trainer.resume={tmp_path / 'src'}", f"predict.input={lines}"], tmp_path / "file"))
    run(compose_spec(["mode=predict", f"trainer.resume={tmp_path / 'src'}", "predict.split=val"], tmp_path / "split"))
    from_file = list(csv.DictReader((tmp_path / "file" / "predictions.csv").open()))
    from_split = list(csv.DictReader((tmp_path / "split" / "predictions.csv").open()))
    assert [r["id"] for r in from_file] == ["0", "2", "3", "4", "5"]  # line numbers; the blank line is no text
    for a, b in zip(from_file, from_split, strict=True):
        assert {k: v for k, v in a.items() if k != "id"} == {k: v for k, v in b.items() if k not in ("id", "label")}


# lr 0.3 overshoots: val/acc is best at step 2 (its first validation) and lower at step 8, the last
BEST_NOT_LAST = ["model.hidden=[16]", "dataset.batch_size=256", "optimizer.lr=0.3", "trainer.max_steps=8",
                 "trainer.eval_every_n_steps=2", "trainer.eval_every_epoch=false", "trainer.progress_bar=off",
                 "trainer.memory_estimate=false"]


@pytest.fixture(scope="module")
def best_not_last(tmp_path_factory: pytest.TempPathFactory, migrated_mlflow_store: Path) -> tuple[Path, str]:
    return trained_run(tmp_path_factory, migrated_mlflow_store, "best_not_last", BEST_NOT_LAST)


def at_step(uri: str, run_id: str, step: int, prefix: str) -> dict[str, float]:
    """The metrics of `prefix` the run logged at `step`, read back from the store."""
    client = MlflowClient(uri)
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith(prefix)]
    return {k: m.value for k in keys for m in client.get_metric_history(run_id, k) if m.step == step}


def model_with(spec, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    data = build_data(spec)
    model = build_model(components.resolved_spec(spec), data)
    model.load_state_dict(weights)
    return model.eval()


def test_eval_and_predict_of_a_run_directory_take_the_weights_the_run_tested_not_the_last(
        best_not_last: tuple, tmp_path: Path) -> None:
    """Defect: eval of a run directory gave the last weights' numbers (step 8), not those of the best weights
    the run tested and reported (step 2)."""
    src, uri = best_not_last
    source_run = (src / RUN_FILE).read_text().strip()
    client = MlflowClient(uri)
    assert client.get_run(source_run).data.tags["test_from"] == "best@step 2"
    val_best, val_last = at_step(uri, source_run, 2, "val/"), at_step(uri, source_run, 8, "val/")
    assert val_best["val/acc"] != val_last["val/acc"]
    tested = {k: v for k, v in client.get_run(source_run).data.metrics.items() if k.startswith("test/")}

    result = run(compose_spec(["mode=eval", f"trainer.resume={src}"], tmp_path / "eval", uri))
    assert result.final == {**val_best, **tested}  # exactly: the weights the run tested, evaluated as it did
    new_run = client.get_run((tmp_path / "eval" / RUN_FILE).read_text().strip())
    assert new_run.data.metrics == result.final and result.steps == 2
    assert new_run.data.tags["runner.evaluated_weights"] == "best@step 2"
    assert new_run.data.tags["runner.evaluated_checkpoint"] == str(src / "checkpoints" / "best-step-00000002.pt")
    last = run(compose_spec(["mode=eval", f"trainer.resume={src}", "weights.which=last", "eval.splits=[val]"],
                            tmp_path / "last"))
    assert last.final == val_last and last.steps == 8

    spec = compose_spec(["mode=predict", f"trainer.resume={src}"], tmp_path / "pred")
    run(spec)
    rows = list(csv.DictReader((tmp_path / "pred" / "predictions.csv").open()))
    source = compose_spec(BEST_NOT_LAST, src)
    data = build_data(source)
    x = torch.stack([data.test[i][0] for i in range(len(data.test))])
    with torch.no_grad():
        best = model_with(source, checkpoint.load(src / "checkpoints" / "best-step-00000002.pt")["model"])(x).argmax(-1)
        final = model_with(source, checkpoint.load(checkpoint.verify(src))["model"])(x).argmax(-1)
    assert not torch.equal(best, final)
    assert [int(r["predicted"]) for r in rows] == best.tolist()


def test_a_best_file_is_a_runner_checkpoint_that_eval_and_export_take_and_a_training_resume_refuses(
        best_not_last: tuple, tmp_path: Path) -> None:
    """Defect: best-step-N.pt was refused as "not a valid runner checkpoint"; a run directory exported its last
    weights."""
    from runner.results.export import export_checkpoint, load_exported
    from runner.engine.resume_source import check_source
    from runner.specs.run import SpecError

    src, uri = best_not_last
    source_run = (src / RUN_FILE).read_text().strip()
    best_file = src / "checkpoints" / "best-step-00000002.pt"
    state = checkpoint.load(best_file)  # header and checksum verified
    assert state["progress"]["step"] == 2 and yaml.safe_load(state["spec"])["trainer"]["max_steps"] == 8
    tested = {k: v for k, v in MlflowClient(uri).get_run(source_run).data.metrics.items() if k.startswith("test/")}
    result = run(compose_spec(["mode=eval", f"trainer.resume={best_file}", "eval.splits=[test]"], tmp_path / "eval"))
    assert result.final == tested

    for target in (best_file, src):  # the file itself, and the run directory's tested weights
        exported = load_exported(export_checkpoint(target, tmp_path / "out" / target.name, program=False)).state_dict()
        assert exported.keys() == state["model"].keys()
        assert all(torch.equal(exported[k], v) for k, v in state["model"].items())
    with pytest.raises(SpecError, match=r"^trainer.resume: .*best-step-00000002.pt holds a run's weights only, not "
                                        r"its training state; train from them with model.weights="):
        check_source(best_file)
    from runner.engine.engine import Engine

    started = Engine(compose_spec([*BEST_NOT_LAST, f"model.weights={best_file}"], tmp_path / "new")).module.state_dict()
    assert all(torch.equal(started[k], v) for k, v in state["model"].items())  # what the refusal suggests works
    with pytest.raises(SpecError, match="^weights.which: best chooses among a run directory's files"):
        run(compose_spec(["mode=eval", f"trainer.resume={best_file}", "weights.which=best"], tmp_path / "refused"))


EMA = [*BEST_NOT_LAST, "trainer.ema.decay=0.9", "objective.metric=val/ema/acc"]


def test_an_ema_run_is_evaluated_with_its_averages_and_exported_and_predicted_with_the_ema_weights(
        tmp_path: Path, store: str) -> None:
    """Defect: eval reported no */ema/* metrics, and export and predict could not take the average the
    objective measured (they wrote the raw weights)."""
    from runner.results.export import export_checkpoint, load_exported

    src = tmp_path / "src"
    run(compose_spec(EMA, src, store))
    source_run = (src / RUN_FILE).read_text().strip()
    client = MlflowClient(store)
    tested = client.get_run(source_run).data.tags["test_from"]
    step = int(tested.rpartition(" ")[2])
    kept = checkpoint.load(src / "checkpoints" / f"best-step-{step:08d}.pt")
    ema, raw = kept["averages"]["ema"]["values"], kept["model"]
    assert not all(torch.equal(ema[k], raw[k]) for k in raw)

    result = run(compose_spec(["mode=eval", f"trainer.resume={src}"], tmp_path / "eval", store))
    logged = client.get_run(source_run).data.metrics
    assert {"val/ema/acc", "test/ema/acc", "test/acc"} <= result.final.keys()
    assert {k: result.final[k] for k in result.final if k.startswith("test/")} == \
        {k: v for k, v in logged.items() if k.startswith("test/")}  # the run's own test numbers, EMA's included
    assert {k: result.final[k] for k in result.final if k.startswith("val/")} == at_step(store, source_run, step, "val/")

    exported = load_exported(export_checkpoint(src, tmp_path / "export", program=False)).state_dict()
    assert all(torch.equal(exported[k], ema[k]) for k in raw)  # auto: the average the objective measured
    as_raw = load_exported(export_checkpoint(src, tmp_path / "raw", program=False, average="none")).state_dict()
    assert all(torch.equal(as_raw[k], raw[k]) for k in raw)

    source = compose_spec(EMA, src)
    data = build_data(source)
    x = torch.stack([data.test[i][0] for i in range(len(data.test))])
    for average, weights in (("auto", ema), ("none", raw)):
        run(compose_spec(["mode=predict", f"trainer.resume={src}", f"weights.average={average}"], tmp_path / average))
        rows = list(csv.DictReader((tmp_path / average / "predictions.csv").open()))
        with torch.no_grad():
            probs = torch.softmax(model_with(source, weights)(x), dim=-1)
        torch.testing.assert_close(torch.tensor([[float(r[f"p_{c}"]) for c in range(10)] for r in rows]), probs,
                                   atol=1e-6, rtol=0)
    spec = yaml.safe_load((tmp_path / "auto" / "spec.yaml").read_text())
    assert spec["weights"] == {"which": "tested", "average": "ema"}  # what it took, for a rerun to take again


@pytest.mark.parametrize("outputs", [1, 2])
def test_predict_on_a_regression_run_writes_the_predicted_values_and_the_real_targets(tmp_path: Path,
                                                                                    outputs: int) -> None:
    """Defect: a regression run predicted class 0 with probability 1.0 and cut the target to an integer; with
    two outputs predict ended in a traceback."""
    user_conf = f"hydra.searchpath=[file://{Path(__file__).resolve().parents[2] / 'user_pkg' / 'conf'}]"

    def compose(overrides: list[str], run_dir: Path):
        return compose_spec([*overrides, user_conf], run_dir)

    train = ["task=regression", "dataset=linear_targets", f"+dataset.outputs={outputs}", "model.hidden=[16]",
             "trainer.max_steps=5", "trainer.progress_bar=off", "trainer.memory_estimate=false"]
    run(compose(train, tmp_path / "src"))
    spec = compose(["mode=predict", f"trainer.resume={tmp_path / 'src'}", "predict.split=val"], tmp_path / "pred")
    run(spec)
    rows = list(csv.DictReader((tmp_path / "pred" / "predictions.csv").open()))
    source = compose(train, tmp_path / "src")
    data = build_data(source)
    x, y = (torch.stack(t) for t in zip(*[data.val[i] for i in range(len(data.val))]))
    with torch.no_grad():
        predicted = model_with(source, checkpoint.load(checkpoint.verify(tmp_path / "src"))["model"])(x)
    columns = ["predicted", "target"] if outputs == 1 else [f"{c}_{i}" for c in ("predicted", "target")
                                                            for i in range(outputs)]
    assert list(rows[0]) == ["id", *columns]
    got = torch.tensor([[float(r[c]) for c in columns] for r in rows])
    torch.testing.assert_close(got[:, :outputs], predicted.reshape(len(x), outputs), atol=1e-6, rtol=0)
    assert torch.equal(got[:, outputs:], y.reshape(len(y), outputs).float())  # the real targets, not integers
    assert not torch.equal(got[:, outputs:], got[:, outputs:].round())


def test_an_swa_objectives_best_file_holds_the_batchnorm_statistics_its_test_used(tmp_path: Path, store: str) -> None:
    """SWA's BatchNorm statistics are recomputed for the best SWA weights before their test: the best file
    keeps them, so an evaluation of the run gives the run's own test/swa/* numbers."""
    src = tmp_path / "src"
    # lr 0.1: val/swa/acc is best at the end of epoch 0 (step 3), lower at the last step (9)
    run(compose_spec(["model=cnn", "model.channels=[8]", "dataset.batch_size=512", "trainer.max_epochs=3",
                      "optimizer.lr=0.1", "trainer.swa.start_epoch=0", "objective.metric=val/swa/acc",
                      "trainer.progress_bar=off", "trainer.memory_estimate=false"], src, store))
    source_run = (src / RUN_FILE).read_text().strip()
    logged = MlflowClient(store).get_run(source_run)
    assert logged.data.tags["test_from"] == "best@step 3"
    result = run(compose_spec(["mode=eval", f"trainer.resume={src}", "eval.splits=[test]"], tmp_path / "eval"))
    assert result.final == {k: v for k, v in logged.data.metrics.items() if k.startswith("test/")}
    assert {"test/swa/acc", "test/acc"} <= result.final.keys()


def test_predict_refuses_an_empty_or_binary_prompt_file_and_a_model_that_cannot_read_the_inputs_in_one_line(
        tmp_path: Path) -> None:
    run(compose_spec(GPT, tmp_path / "gpt"))
    empty, binary, too_long = tmp_path / "empty.txt", tmp_path / "binary.txt", tmp_path / "long.txt"
    empty.write_text("\n  \n")
    binary.write_bytes(b"12 3\n\x89PNG\r\n\x1a\n\xff\xfe")
    too_long.write_text("70 71\n")  # ids beyond the vocabulary of 64: the embedding cannot look them up
    expected = {
        empty: f"predict.input: '{empty}' holds no text; give a text file with one input a line",
        binary: f"predict.input: '{binary}' is not a UTF-8 text file (byte 0x89 at offset 5); give a text file with one "
                "input a line",
        too_long: "predict.input: the model runner.models.gpt.GPT cannot read these inputs (at line 1): IndexError: index out "
                  "of range in self",
    }
    for i, (file, message) in enumerate(expected.items()):
        with pytest.raises(SpecError) as refused:
            run(compose_spec(["mode=predict", f"trainer.resume={tmp_path / 'gpt'}", f"predict.input={file}"],
                             tmp_path / f"pred{i}"))
        assert str(refused.value) == message
        assert not (tmp_path / f"pred{i}" / "predictions.csv").exists()


def test_predict_names_a_corrupt_or_truncated_image_and_writes_no_file(tmp_path: Path) -> None:
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            for i in range(2):
                (tmp_path / "imgs" / split / c).mkdir(parents=True, exist_ok=True)
                Image.fromarray(torch.randint(0, 256, (8, 8, 3), generator=gen, dtype=torch.uint8).numpy()).save(
                    tmp_path / "imgs" / split / c / f"{i}.png")
    run(compose_spec(["dataset=imagefolder", "dataset.batch_size=4", f"dataset.root={tmp_path / 'imgs'}", *TRAIN],
                     tmp_path / "src"))
    whole = (tmp_path / "imgs" / "val" / "cat" / "0.png").read_bytes()
    for name, content in (("garbage", b"not an image at all"), ("truncated", whole[:len(whole) // 2])):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "a.png").write_bytes(whole)
        (folder / "b.png").write_bytes(content)
        with pytest.raises(SpecError) as refused:
            run(compose_spec(["mode=predict", f"trainer.resume={tmp_path / 'src'}", f"predict.input={folder}"],
                             tmp_path / f"pred_{name}"))
        assert str(refused.value).startswith(f"predict.input: 'b.png' in '{folder}' is not an image that can be read (")
        assert str(refused.value).endswith("); remove or replace it") and "\n" not in str(refused.value)
        assert not (tmp_path / f"pred_{name}" / "predictions.csv").exists()


@pytest.mark.parametrize("mode", ["eval", "predict"])
def test_weights_of_another_shape_are_refused_under_the_key_typed_now_with_the_trained_value(
        trained: tuple, tmp_path: Path, mode: str) -> None:
    """Issue 35, item 13: eval of a run with another model.hidden ended in DCP's traceback (a CheckpointException,
    exit 1), and predict's refusal named trainer.resume, which the user had typed right. The line names the key
    that changed the model, its value and the trained run's; a group choice names the option and the run's own."""
    src, _ = trained
    path = checkpoint.verify(src)
    cases = {
        "model.hidden=[32]": f"model.hidden: [32] builds a model the weights of {path} do not fit (",
        "model=cnn": f"model: cnn builds a model the weights of {path} do not fit (the checkpoint has no 0.weight); "
                     "that run was trained with model runner.models.mlp.MLP; allowed: the run's own model (leave "
                     "model=cnn out)",
    }
    for i, (typed, message) in enumerate(cases.items()):
        with pytest.raises(SpecError) as refused:
            run(compose_spec([f"mode={mode}", f"trainer.resume={src}", typed], tmp_path / f"run{i}"))
        assert str(refused.value).startswith(message), str(refused.value)
        assert not (tmp_path / f"run{i}").exists()  # refused before the run's records exist
    assert str(refused.value).count("\n") == 0
    hidden = str(pytest.raises(SpecError, run, compose_spec([f"mode={mode}", f"trainer.resume={src}",
                                                              "model.hidden=[32]"], tmp_path / "again")).value)
    assert hidden.endswith("that run was trained with model.hidden=[256, 128]; allowed: model.hidden=[256, 128], or "
                           "leave model.hidden out")
