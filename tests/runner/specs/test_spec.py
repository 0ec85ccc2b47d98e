import dataclasses
import sys
from pathlib import Path

import pytest

from runner.specs import registry
from runner.specs.metric_names import evaluation_metrics, produced_metrics, with_task_declarations
from runner.specs.optimizer import OptimizerSpec
from runner.specs.run import OPTION_GROUPS, RunSpec, SpecError, check_option
from runner.specs.tracking import TrackingSpec
from tests.conftest import compose_spec


def test_default_spec_composes_and_round_trips_through_yaml(tmp_path: Path) -> None:
    spec = compose_spec([], tmp_path / "run")
    assert spec.dataset.target == "runner.data.digits.build" and spec.accumulation.steps == 1
    again = RunSpec.from_yaml(spec.to_yaml())
    assert again == spec


def test_yaml_defaults_equal_the_spec_defaults(tmp_path: Path) -> None:
    """conf/ is where users read the defaults; the dataclasses must not say otherwise."""
    composed = compose_spec([], tmp_path / "run")
    defaults = RunSpec(run_dir=str(tmp_path / "run"), overrides=composed.overrides,
                       tracking=dataclasses.replace(TrackingSpec(), name="none"))  # compose_spec adds tracking=none
    defaults = with_task_declarations(defaults)  # as every spec built from conf/: the objective's direction resolved
    # a component's own keys are its callable's (its signature's defaults: tests/models/test_model_confs.py)
    own = [k for k in composed.flat() if k.startswith(("model.", "dataset.", "task.", "optimizer.", "scheduler."))
           and k not in defaults.flat()]
    differing = {k: (v, defaults.flat()[k]) for k, v in composed.flat().items() if k not in own and defaults.flat()[k] != v}
    assert differing == {}
    assert composed.trainer.max_non_finite_steps == 3 and composed.trainer.max_epochs == 20


@pytest.mark.parametrize("group", OPTION_GROUPS)
def test_every_option_of_every_group_composes_into_a_valid_spec(tmp_path: Path, group: str) -> None:
    for option in registry.options(group):
        spec = compose_spec([f"{group}={option}"], tmp_path / "run", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        assert getattr(spec, group).name == option


@pytest.mark.parametrize("group", ["task", "optimizer", "scheduler"])
def test_every_option_of_the_training_parts_resolves_against_its_callable(tmp_path: Path, group: str) -> None:
    from runner.specs import components

    for option in registry.options(group):
        spec = components.resolved_spec(compose_spec([f"{group}={option}"], tmp_path / "run"))
        assert getattr(spec, group).target.count(".") >= 2, option  # a dotted path: package.module.callable


def test_accum_shorthand_sets_accumulation_steps(tmp_path: Path) -> None:
    spec = compose_spec(["+accum=4"], tmp_path / "run")
    assert spec.accumulation.steps == 4
    assert "accum" not in spec.to_dict()  # spec.yaml holds only the resolved key


def test_accum_shorthand_agreeing_with_explicit_key_is_fine(tmp_path: Path) -> None:
    assert compose_spec(["+accum=2", "accumulation.steps=2"], tmp_path / "run").accumulation.steps == 2


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.lr=abc"], "optimizer.lr: 'abc' is not a number; allowed: a value > 0"),
    (["optimizer.lr=-1"], "optimizer.lr: -1.0 is out of range; allowed: a value > 0"),
    (["optimizer.lr=inf"], "optimizer.lr: inf is not a finite number; allowed: a value > 0"),
    (["optimizer.lr=1e400"], "optimizer.lr: inf is not a finite number"),
    (["optimizer.lr=nan"], "optimizer.lr: nan is not a number"),
    (["optimizer.lr=1" + "0" * 400], "optimizer.lr: 100000000000... (401 digits) is too large"),
    (["optimizer.weight_decay=inf"], "optimizer.weight_decay: inf is not a finite number; allowed: a value >= 0"),
    (["trainer.clip_grad_norm=inf"], "trainer.clip_grad_norm: inf is not a finite number"),
    (["optimizer.betas=[0.9]"], "optimizer.betas: [0.9] is not allowed; give a list of 2 numbers"),
    (["optimizer.betas=[0.9,1.0]"], "optimizer.betas[1]: 1.0 is out of range; allowed: a value >= 0 and < 1"),
    (["optimizer.impl=fast"], "optimizer.impl: 'fast' is not allowed; choose one of auto, fused, foreach, for_loop"),
    (["+accum=0"], "accumulation.steps: 0 is out of range; allowed: a value > 0"),
    (["dataset.batch_size=0"], "dataset.batch_size: 0 is out of range; allowed: a value > 0"),
    (["dataset.batch_size=100000000"], "dataset.batch_size: 100000000 is out of range; allowed: a value > 0 and <= 1048576"),
    (["+accum=4", "accumulation.steps=2"], "accum: +accum=4 conflicts with accumulation.steps=2; set only one"),
    (["trainer.device=tpu"], "trainer.device: 'tpu' is not allowed; choose one of auto, cpu, cuda"),
    (["precision.name=fp17"], "precision.name: unknown option 'fp17'; did you mean fp16? choose one of bf16,"),
    (["trainer.max_steps=1.5"], "trainer.max_steps: 1.5 is not an integer"),
    (["trainer.max_non_finite_steps=0"], "trainer.max_non_finite_steps: 0 is out of range; allowed: a value > 0"),
    (["trainer.clip_grad_norm=1", "trainer.clip_grad_value=1"], "trainer.clip_grad_value: set either clip_grad_norm or clip_grad_value"),
    (["parallelism.nnodes=2"], "parallelism.nnodes: 2 needs several processes but parallelism=single runs one; "
                               "add parallelism=ddp or parallelism=fsdp"),
    (["parallelism.nproc_per_node=4"], "parallelism.nproc_per_node: 4 needs several processes"),
])
def test_bad_values_name_the_key_the_value_and_what_is_allowed(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError) as err:
        compose_spec(overrides, tmp_path / "run")
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_option_names_are_checked_by_one_function_that_suggests_the_closest() -> None:
    check_option("optimizer", "adamw")
    with pytest.raises(SpecError, match=r"^optimizer: unknown option 'adamm'; did you mean adam\? choose one of "):
        check_option("optimizer", "adamm")
    with pytest.raises(SpecError, match=r"^precision.name: unknown option 'zzz'; choose one of bf16, bf16_true"):
        check_option("precision", "zzz", "precision.name")


def test_kernel_names_live_in_the_spec_type_alone() -> None:
    import typing

    import runner.engine.optim as optim

    assert typing.get_args(typing.get_type_hints(OptimizerSpec)["impl"]) == ("auto", "fused", "foreach", "for_loop")
    assert not hasattr(optim, "IMPLS")


def test_produced_metrics_follow_the_splits_the_precision_and_the_evaluation_schedule(tmp_path: Path) -> None:
    base = {"train/loss", "lr", "grad_norm", "epoch", "throughput/samples_per_s", "throughput/tflops", "objective"}
    evals = {"val/loss", "val/acc", "val/top5", "test/loss", "test/acc", "test/top5"}
    assert produced_metrics(compose_spec([], tmp_path)) == base | evals
    assert produced_metrics(compose_spec(["precision=fp16"], tmp_path)) == base | evals | {"fp16/skipped_steps"}
    no_val = compose_spec(["dataset.val_fraction=0", "objective.metric=test/acc"], tmp_path)
    val, test = {"val/loss", "val/acc", "val/top5"}, {"test/loss", "test/acc", "test/top5"}
    assert produced_metrics(no_val) == base | test
    no_test = compose_spec(["dataset.test_fraction=0"], tmp_path)
    assert evaluation_metrics(no_test) == (val, set())
    # mnist has an official test split: its builder takes no test_fraction
    mnist = compose_spec(["dataset=mnist"], tmp_path)
    assert evaluation_metrics(mnist) == (val, test)
    never = compose_spec(["trainer.eval_every_epoch=false", "objective.metric=test/loss"], tmp_path)
    assert evaluation_metrics(never) == (set(), test)
    assert evaluation_metrics(compose_spec(["trainer.eval_every_epoch=false", "trainer.eval_every_n_steps=5"],
                                           tmp_path))[0] == val
    lm = compose_spec(["task=language_modeling"], tmp_path)
    assert evaluation_metrics(lm) == ({"val/loss", "val/ppl"}, {"test/loss", "test/ppl"})


def test_produced_metrics_does_not_import_torch(tmp_path: Path) -> None:
    import subprocess

    code = ("import sys; from runner.specs.metric_names import produced_metrics; from runner.specs.run import RunSpec; "
            "produced_metrics(RunSpec()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mlflow', 'optuna')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("overrides, message", [
    (["trainer.early_stopping.monitor=val/los"],
     "trainer.early_stopping.monitor: 'val/los' is not a metric this run evaluates; did you mean val/loss? "
     "choose one of val/acc, val/loss, val/top5"),
    (["trainer.early_stopping.monitor=test/acc"],
     "trainer.early_stopping.monitor: 'test/acc' is evaluated only at the end of the run; choose one of val/acc, val/loss, val/top5"),
    (["objective.metric=val/accuracy"],
     "objective.metric: 'val/accuracy' is not a metric this run evaluates; did you mean val/acc? "
     "choose one of test/acc, test/loss, test/top5, val/acc, val/loss, val/top5"),
    (["dataset.val_fraction=0"],
     "objective.metric: 'val/acc' is never evaluated in this run: dataset.val_fraction=0 leaves no validation split"),
    (["dataset.val_fraction=0", "objective.metric=test/acc", "trainer.early_stopping.monitor=val/loss"],
     "trainer.early_stopping.monitor: 'val/loss' is never evaluated in this run: dataset.val_fraction=0 leaves no "
     "validation split; set dataset.val_fraction > 0, or trainer.early_stopping.monitor=null"),
    (["trainer.eval_every_epoch=false", "trainer.early_stopping.monitor=val/loss"],
     "trainer.early_stopping.monitor: 'val/loss' is never evaluated in this run: trainer.eval_every_epoch=false and "
     "trainer.eval_every_n_steps=0 never evaluate; set one of them, or trainer.early_stopping.monitor=null"),
    (["dataset.test_fraction=0", "objective.metric=test/acc"],
     "objective.metric: 'test/acc' is never evaluated in this run: dataset.test_fraction=0 leaves no test split; "
     "set dataset.test_fraction > 0, or choose one of val/acc, val/loss"),
    (["scheduler=plateau", "scheduler.monitor=val/los"], "scheduler.monitor: 'val/los' is not a metric this run evaluates"),
    (["scheduler=plateau", "scheduler.monitor=test/loss"], "scheduler.monitor: 'test/loss' is evaluated only at the end"),
])
def test_metric_names_must_be_ones_the_run_evaluates(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError) as err:
        compose_spec(overrides, tmp_path / "run")
    assert str(err.value).startswith(message)


def test_metric_names_the_run_evaluates_are_accepted(tmp_path: Path) -> None:
    spec = compose_spec(["trainer.early_stopping.monitor=val/acc", "scheduler=plateau", "scheduler.monitor=val/acc",
                         "objective.metric=test/loss"], tmp_path / "run")
    assert spec.objective.metric == "test/loss"
    # evaluation turned off on purpose (benchmarks): the objective names a metric the splits hold
    assert compose_spec(["trainer.eval_every_epoch=false"], tmp_path / "run").objective.metric == "val/acc"
    # a schedule not driven by evaluations takes no monitor: a key given must do something
    with pytest.raises(SpecError, match=r"^scheduler\.monitor: 'nothing' is not a metric this run evaluates"):
        compose_spec(["+scheduler.monitor=nothing"], tmp_path / "run")


def test_flat_params_cover_every_leaf(tmp_path: Path) -> None:
    flat = compose_spec(["optimizer=adamw"], tmp_path / "run").flat()
    assert flat["optimizer._target_"] == "torch.optim.AdamW" and "optimizer.momentum" not in flat
    assert flat["trainer.early_stopping.patience"] == 5
    assert "dataset.batch_size" in flat
