"""The composition table (runner/specs/composition.py): README states it, every built cell names a test that
exists, each built cell that needs processes runs on 2 gloo processes against one process (one run per
composition, every feature of the cells at once), and a refused composition is one line, exit 2, before any
run directory or worker exists.

Tolerance: as test_pipeline_parallel.py and test_tensor_parallel.py (fp32, another order of the same sums):
losses rtol 1e-5, weights rtol 1e-4 of each tensor's largest value. SGD with momentum: a gradient that is 0 in
exact arithmetic is rounding noise in both runs, which Adam would scale up to lr-sized steps.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.specs import composition
from runner.specs.run import SpecError
from tests.conftest import compose_spec, run_cli
from tests.runner.engine.test_parallel import assert_same, final_weights, metric_history

ROOT = Path(__file__).resolve().parents[3]

# 32 training blocks: batch 8 x accum 2, 2 optimizer steps an epoch, 2 epochs; 4 blocks to validate, 4 to test
GPT = ["dataset=synthetic_tokens", "dataset.vocab_size=64", "dataset.block_size=16", "dataset.size=40",
       "dataset.val_fraction=0.1", "dataset.test_fraction=0.1", "model=gpt", "model.n_layer=2", "model.n_embd=16",
       "model.n_head=2", "model.bias=false", "task=language_modeling", "optimizer=sgd", "optimizer.momentum=0.9",
       "trainer.max_epochs=2", "trainer.progress_bar=off", "trainer.eval_every_n_steps=2", "trainer.log_every_n_steps=1",
       "trainer.clip_grad_norm=0.5", "trainer.ema.decay=0.9", "trainer.swa.start_epoch=1",
       "trainer.activation_checkpointing=full", "trainer.test_on=best",
       "+trainer.callbacks=[{_target_:tests.user_pkg.callbacks.StepCounter}]", "+accum=2"]
# each composition: its keys, the per-rank batch (the global batch is 8 everywhere), and whether it logs the model;
# the profiler runs in each (it changes no number), not in the one process it is compared with
COMPOSITIONS = {
    "ddp": (["parallelism=ddp", "parallelism.nproc_per_node=2"], 4, True),
    "fsdp": (["parallelism=fsdp", "parallelism.nproc_per_node=2"], 4, True),
    "tp": (["parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.tp=2"], 8, True),
    "pp": (["parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.pp=2"], 8, False),
}
PROFILED = ["trainer.profile=true", "trainer.profile_skip_steps=1", "trainer.profile_steps=2"]
COMPARED = ("train/loss", "val/loss", "val/ema/loss", "test/loss", "test/ema/loss", "lr", "user/steps", "user/evaluations")


# --- the table, README and the tests it names ---------------------------------------------------------------

def test_readme_states_the_codes_table() -> None:
    """README's Model parallelism section holds markdown_table()'s text as it is (regenerate it from the code)."""
    readme = (ROOT / "README.md").read_text()
    assert composition.markdown_table() in readme, ("README's composition table differs from runner/specs/composition.py; "
                                                    "paste composition.markdown_table() into it")


def test_every_built_cell_names_a_test_that_exists() -> None:
    """A new built cell without a test fails here: its test file must hold the named test (and its parameter)."""
    for feature, cells in composition.TABLE.items():
        for dim, cell in cells.items():
            if not cell.built:
                assert cell.why, (feature, dim)
                continue
            assert cell.test, f"{feature} x {dim} is built but names no test"
            path, _, name = cell.test.partition("::")
            name, _, param = name.partition("[")
            source = (ROOT / path).read_text()
            assert f"def {name}(" in source, cell.test
            if param:
                assert f'"{param.rstrip("]")}"' in source, cell.test


def test_the_model_parallelism_sections_commands_are_accepted_as_written(tmp_path: Path) -> None:
    """Every `python -m runner ...` of README's Model parallelism section passes the checks preflight makes (the
    spec, the composition table, the model's and dataset's arguments against each other): they named model=gpt on
    the default digits data and were refused as written."""
    from runner.specs import components
    from runner.specs.resume import typed_keys

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Model parallelism"):readme.index("## Where things go")]
    commands = re.findall(r"`python -m runner ([^`]*)`", section)
    assert len(commands) >= 10
    built: set[str] = set()
    for i, command in enumerate(commands):
        spec = components.resolved_spec(compose_spec(command.split(), tmp_path / f"run{i}"), typed_keys(command.split()))
        if repr(spec.dataset) not in built:  # the data against the model and the task, as the run builds them
            components.build_data(spec)
            built.add(repr(spec.dataset))


# --- refusals, while the spec is built --------------------------------------------------------------------------

LM = ["task=language_modeling", "model=gpt", "dataset=synthetic_tokens"]


@pytest.mark.parametrize("overrides, message", [
    ([*LM, "parallelism.pp=2", "precision=fp16"],
     "precision=fp16 with parallelism.pp=2: fp16's loss scaling is not built into the pipeline schedules"),
    ([*LM, "parallelism=fsdp", "parallelism.nproc_per_node=8", "parallelism.pp=2", "parallelism.tp=2"],
     "parallelism.pp=2 with parallelism=fsdp (parallelism.dp_shard=2) with parallelism.tp=2: pp x fsdp x tp is not built"),
    ([*LM, "parallelism=hsdp", "parallelism.nproc_per_node=8", "parallelism.dp_replicate=2", "parallelism.pp=2"],
     "parallelism.pp=2 with parallelism.dp_replicate=2 with parallelism=hsdp (parallelism.dp_shard=2): pp x hsdp"),
    ([*LM, "parallelism.pp=2", "trainer.compile=true"], "trainer.compile=True with parallelism.pp=2: compiling"),
    ([*LM, "parallelism.pp=2", "tracking.log_model=last"], "tracking.log_model=last with parallelism.pp=2: logging the"),
    ([*LM, "parallelism.tp=2", "tune=lr_find"], "tune=lr_find with parallelism.tp=2: the finders under sharding or "
     "model parallelism are not tested yet"),
    # issue 35 item 5: the batch-size finder under pp timed batches it never ran; refused before anything starts
    ([*LM, "parallelism.pp=2", "tune=batch_size"], "tune=batch_size with parallelism.pp=2: the finders under sharding "
     "or model parallelism are not tested yet"),
    (["parallelism=ddp", "parallelism.nproc_per_node=2", "tune=lr_find"], None),  # built: no refusal
    ([*LM, "parallelism.tp=2", "trainer.cross_validation.folds=2"],
     "trainer.cross_validation.folds=2 with parallelism.tp=2: k-fold's folds under sharding or model parallelism are "
     "not tested"),
    (["parallelism=ddp", "parallelism.nproc_per_node=2", "tune=lr_find", "trainer.cross_validation.folds=2"],
     "tune=lr_find with trainer.cross_validation.folds=2 and parallelism=ddp (parallelism.dp_replicate=2): the finder "
     "runs once for every fold, in this process"),
    (["mode=eval", "parallelism.tp=2", "trainer.resume=somewhere"],
     "mode=eval with parallelism.tp=2: runs in one process"),
    ([*LM, "parallelism.pp=2", "parallelism.pp_microbatches=1"],
     "parallelism.pp_microbatches: 1 with pp_schedule=1f1b and parallelism.pp=2: 1F1B needs at least one micro-batch "
     "per stage"),
    ([*LM, "parallelism.pp=2", "parallelism.pp_schedule=interleaved_1f1b", "parallelism.pp_microbatches=5"],
     "parallelism.pp_microbatches: 5 with pp_schedule=interleaved_1f1b and parallelism.pp=2: the micro-batches must be "
     "a multiple of their 2 rounds"),
    ([*LM, "parallelism.pp=4", "parallelism.pp_schedule=interleaved_1f1b", "dataset.batch_size=4"],
     "parallelism.pp_microbatches: -1 (one per stage: 8) micro-batches cannot be cut from a batch of 4"),
])
def test_a_refused_composition_is_one_line_while_the_spec_is_built(tmp_path: Path, overrides: list[str],
                                                                   message: str | None) -> None:
    if message is None:
        compose_spec(overrides, tmp_path / "run")
        return
    with pytest.raises(SpecError) as e:
        compose_spec(overrides, tmp_path / "run")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_pipeline_input_that_cannot_be_built_is_refused_before_any_worker_or_run_directory(tmp_path: Path) -> None:
    """`python -m runner parallelism.pp=2` (mlp on digits) was refused only inside the workers, after torch's
    launcher lines, leaving spec.yaml: the corrected command was then refused as "already holds a run". Now the
    launcher refuses it on the model built on the meta device: one line, exit 2, no worker, no run directory."""
    proc = run_cli(["parallelism.pp=2", "tracking=none", "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: parallelism.pp: runner.models.mlp.MLP has no pipeline plan")
    assert "workers" not in proc.stdout + proc.stderr  # no worker was started
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, message", [
    ([*LM, "model.n_layer=2", "parallelism.pp=4", "dataset.batch_size=8"],
     "parallelism.pp: stage 0 of 4 cannot be cut from runner.models.gpt.GPT: num_stages: 4 stages cannot be cut "
     "from 2 blocks"),
    (["model=cnn", "parallelism.pp=2"], "model: runner.models.cnn.CNN's BatchNorm layer"),
    (["model=cnn", "parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.tp=2"],
     "model: runner.models.cnn.CNN's BatchNorm layer"),
])
def test_the_launcher_refuses_what_the_model_decides_before_it_starts_workers(tmp_path: Path, args: list[str],
                                                                              message: str) -> None:
    """launch_workers calls check_parallel before it writes spec.yaml or starts a worker (the test above)."""
    from runner.cli import launch

    with pytest.raises(SpecError) as e:
        launch.check_parallel(compose_spec(args, tmp_path / "run"))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# --- each built cell that needs processes, against one process --------------------------------------------------

@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    from runner.engine.engine import Engine
    from runner.tracking.tracker import build_tracker

    where = tmp_path_factory.mktemp("one") / "run"
    spec = compose_spec([*GPT, "dataset.batch_size=8"], where, tracking_uri=f"sqlite:///{where.parent / 'one.db'}")
    Engine(spec, build_tracker(spec)).fit()
    return final_weights(where), metric_history(where.parent / "one.db")


def _fit_on_rank(rank: int, world: int, overrides: list[str], run_dir: str, db: str) -> None:
    from runner.engine.engine import Engine
    from runner.engine.parallel import DistEnv
    from runner.tracking.tracker import build_tracker

    spec = compose_spec(overrides, Path(run_dir), tracking_uri=f"sqlite:///{db}")
    Engine(spec, build_tracker(spec, rank), env=DistEnv(rank, world, rank)).fit()


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_a_built_cell_trains_like_one_process(name: str, tmp_path: Path, one_process: tuple, two_ranks) -> None:
    """Accumulation with a clipped norm, EMA and SWA, activation checkpointing, a user's callback, the memory
    estimate, test on best, the profiler and (but under pp) log_model, all at once on 2 processes: the final
    weights and every logged loss (the EMA's and the test on best's too), lr and the callback's counts are one
    process's on the same global batch."""
    keys, batch, logs_model = COMPOSITIONS[name]
    db = tmp_path / "two.db"
    overrides = [*GPT, *keys, *PROFILED, f"dataset.batch_size={batch}",
                 *(["tracking.log_model=last"] if logs_model else [])]
    two_ranks.run(_fit_on_rank, overrides, str(tmp_path / "two"), str(db))
    weights, metrics = one_process
    assert_same(final_weights(tmp_path / "two"), weights, rtol=1e-4)
    logged = metric_history(db)
    for key in COMPARED:
        assert [s for s, _ in logged[key]] == [s for s, _ in metrics[key]], key
        for (_, a), (_, b) in zip(metrics[key], logged[key]):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7), key
    # the callback counts the samples of its own rank: a data-parallel rank's share, a model-parallel rank's whole batch
    share = 2 if name in ("ddp", "fsdp") else 1
    assert [(s, v * share) for s, v in logged["user/samples"]] == metrics["user/samples"]
    assert "profile/step_ms" in logged  # the profiler's window ran
    if logs_model:
        import sqlite3

        with sqlite3.connect(db) as store:
            tags = dict(store.execute("select key, value from tags").fetchall())
        assert re.search(r"\(last@step \d+\)$", tags.get("runner.logged_model", "")), tags


# --- cells without the other features: fp16's loss scaling, and compile (dynamo's tracing, on torch's eager
# backend: the same guards and graphs, no code generation) --------------------------------------------------------

PLAIN = [o for o in GPT if not o.startswith(("trainer.ema", "trainer.swa", "trainer.activation", "+trainer.callbacks"))]


def _one_and_two_ranks(tmp_path: Path, two_ranks, overrides: list[str], keys: list[str], batch: int,
                       fit=None) -> tuple[dict, dict]:
    """One process on the global batch of 8 and 2 ranks of `batch` rows each, both from `overrides`: their metrics."""
    from runner.engine.engine import Engine
    from runner.tracking.tracker import build_tracker

    spec = compose_spec([*overrides, "dataset.batch_size=8"], tmp_path / "one", tracking_uri=f"sqlite:///{tmp_path / 'one.db'}")
    Engine(spec, build_tracker(spec)).fit()
    two_ranks.run(fit or _fit_on_rank, [*overrides, *keys, f"dataset.batch_size={batch}"], str(tmp_path / "two"),
                  str(tmp_path / "two.db"))
    return metric_history(tmp_path / "one.db"), metric_history(tmp_path / "two.db")


def _assert_losses_alike(one: dict, two: dict, rel: float) -> None:
    for key in ("train/loss", "val/loss", "test/loss"):
        assert [s for s, _ in two[key]] == [s for s, _ in one[key]], key
        for (_, a), (_, b) in zip(one[key], two[key]):
            assert b == pytest.approx(a, rel=rel, abs=1e-6), key


# ddp: autocast on every rank, as one process: weights and losses alike. fsdp: FSDP2's MixedPrecisionPolicy casts
# the parameters to fp16 for the forward and reduces the gradients in fp32, another rounding than one process's
# autocast: its losses are close (1e-3; 1e-4 seen), its weights off by more than 1e-4 of their largest value
FP16 = {
    "ddp-fp16": (["parallelism=ddp", "parallelism.nproc_per_node=2"], 1e-4),
    "fsdp-fp16": (["parallelism=fsdp", "parallelism.nproc_per_node=2"], 1e-3),
}


@pytest.mark.parametrize("name", list(FP16))
def test_fp16s_loss_scaling_trains_like_one_process(name: str, tmp_path: Path, two_ranks) -> None:
    """GradScaler on 2 ranks (unscaled before the clipped norm, a step skipped on every rank or none): the steps it
    skipped and every loss are one process's on the same global batch."""
    keys, rtol = FP16[name]
    one, two = _one_and_two_ranks(tmp_path, two_ranks, [*PLAIN, "precision=fp16"], keys, 4)
    _assert_losses_alike(one, two, rtol)
    assert two["fp16/skipped_steps"] == one["fp16/skipped_steps"]
    if name == "ddp-fp16":
        assert_same(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), rtol=rtol)


SLOW = {
    "ddp-compile": (["parallelism=ddp", "parallelism.nproc_per_node=2"], 4),
    "fsdp-compile": (["parallelism=fsdp", "parallelism.nproc_per_node=2"], 4),
    "tp-compile": (["parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.tp=2"], 8),
}


def _fit_eager(rank: int, world: int, overrides: list[str], run_dir: str, db: str) -> None:
    from runner.engine import compiling

    compiling.BACKEND = "eager"
    _fit_on_rank(rank, world, overrides, run_dir, db)


@pytest.mark.slow  # dynamo traces the model on every rank (tens of seconds on a CPU)
@pytest.mark.parametrize("name", list(SLOW))
def test_a_slow_cell_trains_like_one_process(name: str, tmp_path: Path, two_ranks, monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.engine import compiling

    keys, batch = SLOW[name]
    monkeypatch.setattr(compiling, "BACKEND", "eager")
    one, two = _one_and_two_ranks(tmp_path, two_ranks, [*PLAIN, "trainer.compile=true"], keys, batch, fit=_fit_eager)
    assert_same(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), rtol=1e-4)
    _assert_losses_alike(one, two, 1e-4)


def _trial_on_rank(rank: int, world: int, overrides: list[str], run_dir: str, db: str) -> None:
    from runner.cli import launch
    from runner.engine.parallel import DistEnv
    from runner.tracking.tracker import build_tracker

    spec = compose_spec(overrides, Path(run_dir), tracking_uri=f"sqlite:///{db}")
    launch.build_engine(spec, build_tracker(spec, rank), DistEnv(rank, world, rank)).fit()


def test_an_optuna_trial_under_ddp_reports_like_one_process(tmp_path: Path, two_ranks) -> None:
    """A trial's run on 2 processes reports its validations to the study once, at the steps and values of one
    process's trial."""
    import optuna

    def trial_keys(name: str) -> list[str]:
        storage = f"sqlite:///{tmp_path / name}.optuna.db"
        study = optuna.create_study(storage=storage, study_name=name)
        number = study.ask().number
        return [f"trial.storage={storage}", f"trial.study_name={name}", f"trial.number={number}"]

    plain = [*PLAIN, "trainer.test_on=last"]
    _trial_on_rank(0, 1, [*plain, *trial_keys("one"), "dataset.batch_size=8"], str(tmp_path / "one"),
                   str(tmp_path / "one.db"))
    two_ranks.run(_trial_on_rank, [*plain, *trial_keys("two"), "parallelism=ddp", "parallelism.nproc_per_node=2",
                                   "dataset.batch_size=4"], str(tmp_path / "two"), str(tmp_path / "two.db"))

    def reported(name: str) -> dict[int, float]:
        study = optuna.load_study(storage=f"sqlite:///{tmp_path / name}.optuna.db", study_name=name)
        return study.trials[0].intermediate_values

    one, two = reported("one"), reported("two")
    assert one and list(two) == list(one)
    assert list(two.values()) == pytest.approx(list(one.values()), rel=1e-5)


def _run_on_rank(rank: int, world: int, overrides: list[str], run_dir: str) -> None:
    from runner.cli import launch
    from runner.engine.parallel import DistEnv

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    launch.run_in_process(compose_spec(overrides, Path(run_dir)), DistEnv(rank, world, rank))


def test_the_lr_finder_under_ddp_suggests_and_trains_like_one_process(tmp_path: Path, two_ranks) -> None:
    """tune=lr_find tune.apply=true on 2 processes: the ranks' one suggestion is one process's on the same global
    batch (its curve is the global batch's loss), and the run trains with it to one process's weights."""
    import yaml

    finder = [*PLAIN, "tune=lr_find", "tune.steps=12", "tune.apply=true"]
    _run_on_rank(0, 1, [*finder, "dataset.batch_size=8"], str(tmp_path / "one"))
    two_ranks.run(_run_on_rank, [*finder, "parallelism=ddp", "parallelism.nproc_per_node=2", "dataset.batch_size=4"],
                  str(tmp_path / "two"))

    def lr(run: str) -> float:
        return yaml.safe_load((tmp_path / run / "spec.yaml").read_text())["optimizer"]["lr"]

    assert lr("two") == pytest.approx(lr("one"), rel=1e-6)
    assert_same(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"), rtol=1e-4)


@pytest.mark.parametrize("args, message", [
    (["parallelism=ddp", "parallelism.nproc_per_node=2"],
     "error: hydra/sweeper=pbt with parallelism=ddp (parallelism.dp_replicate=2): PBT trains each member in one process"),
    (["parallelism.tp=2", "task=language_modeling", "model=gpt", "dataset=synthetic_tokens"],
     "error: hydra/sweeper=pbt with parallelism.tp=2: PBT trains each member in one process"),
])
def test_pbt_in_a_parallel_dimension_is_refused_before_its_sweep_folder_exists(tmp_path: Path, args: list[str],
                                                                                message: str) -> None:
    """Its members train in one process each: under ddp each trained at half the global batch its spec.yaml
    recorded, silently; under tp it was refused with a line about dp_replicate, after the sweep folder was made."""
    proc = run_cli(["-m", "hparams_search=digits_pbt", *args, "tracking=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "outputs").exists()


def test_an_optuna_study_in_a_dimension_the_table_refuses_is_one_line_before_its_sweep_folder(tmp_path: Path) -> None:
    """A job's spec does not know its sweeper: preflight checks the sweep's jobs against the table."""
    proc = run_cli(["-m", "hparams_search=digits_optuna", "parallelism.tp=2", "task=language_modeling", "model=gpt",
                    "dataset=synthetic_tokens", "tracking=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: hydra/sweeper=runner_optuna with parallelism.tp=2: Optuna trials under "
                                   "sharding or model parallelism are not tested; search with ddp or one process")
    assert not (tmp_path / "sweep").exists()
