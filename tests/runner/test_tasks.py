"""Tasks (runner/tasks): a user's task trains through the Engine; a metric's direction is the one its task
declares; an empty rank share counts 0 and adds nothing for every kind of batch; one loss path."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runner.engine.engine import Engine
from runner.engine.loader import EmptyShare
from tests.test_open_world import compose

SHARES = ["dataset=shares", "optimizer=sgd", "optimizer.lr=0.5", "optimizer.momentum=0", "optimizer.weight_decay=0",
          "trainer.progress_bar=off",
          "trainer.max_steps=2", "trainer.eval_every_epoch=false"]
OWN_LOSS = "model._target_=tests.user_pkg.shares.OwnLossNet"


def with_task(spec, target: str):
    """The spec naming a user's task class with its own defaults."""
    return spec.replace(task=dataclasses.replace(spec.task, target=target, params={}))


def test_a_users_focal_loss_trains_through_the_engine_and_is_the_loss_trained(tmp_path: Path) -> None:
    from tests.user_pkg.focal import FocalLoss

    spec = compose(["trainer.max_steps=12", "trainer.log_every_n_steps=1", "trainer.eval_every_epoch=false",
                    "trainer.progress_bar=off", "dataset.batch_size=32"], tmp_path)
    engine = Engine(with_task(spec, "tests.user_pkg.focal.FocalLoss"))
    assert isinstance(engine.task, FocalLoss)
    engine.train_loader.batch_sampler.set_epoch(0)
    x, y = next(iter(engine.train_loader))
    first = (FocalLoss().loss_sum(engine.module(x), y) / len(y)).item()
    result = engine.fit()
    history = engine.monitor.history
    assert history["train/loss"][0][1] == pytest.approx(first, rel=1e-6)  # the focal loss, not cross-entropy
    assert set(result.final) == {"test/loss", "test/acc"} and result.final["test/acc"] > 0.5


def test_a_metric_a_users_task_declares_maximized_is_maximized_by_best_early_stopping_and_plateau(tmp_path: Path) -> None:
    """R^2 rises as the model learns: read as a loss-like metric, early stopping (patience 1) would stop
    at the second evaluation, plateau (patience 0) would cut the lr at each, and best_<metric> keep the worst."""
    spec = compose(["task=regression", "dataset=linear_targets", "+dataset.outputs=1", "model.hidden=[16]",
                    "optimizer=sgd", "optimizer.lr=0.02", "trainer.max_epochs=5", "trainer.progress_bar=off",
                    "trainer.log_every_n_steps=1", "trainer.early_stopping.patience=1", "scheduler=plateau",
                    "scheduler.patience=0", "objective.metric=val/loss", "objective.direction=minimize"], tmp_path)
    # the monitors set here, not composed: the spec checks them against the configured task's metrics
    trainer = dataclasses.replace(spec.trainer, early_stopping=dataclasses.replace(spec.trainer.early_stopping,
                                                                                   monitor="val/r2"))
    spec = spec.replace(trainer=trainer, scheduler=dataclasses.replace(spec.scheduler, monitor="val/r2"))
    engine = Engine(with_task(spec, "tests.user_pkg.regression.R2Regression"))
    assert engine.spec.trainer.early_stopping.mode == "max" and engine.spec.scheduler.params["mode"] == "max"
    engine.fit()
    r2 = [v for _, v in engine.monitor.history["val/r2"]]
    assert len(r2) == 5 and all(b > a for a, b in zip(r2, r2[1:]))  # rose at every evaluation: never stopped
    assert engine.monitor.best["val/r2"] == max(r2)
    assert {v for _, v in engine.monitor.history["lr"]} == {0.02}  # plateau never cut the lr


KINDS = {  # one kind of batch each: the stand-in must count 0 and move nothing
    "tuple, map-style with a collate": [],
    "dict, a model's own loss": ["dataset.layout=dict", OWN_LOSS],
    "tuple, a model's own loss": [OWN_LOSS],
    "regression": ["task=regression", "dataset.targets=values"],
    "mixup": ["dataset.mixup_alpha=0.4"],
    "language modelling, dict": ["task=language_modeling", "dataset=padded_tokens", "model=gpt", "model.size=tiny",
                                 "model.n_embd=32", "model.n_head=2"],
    "in-memory tensors": ["dataset=synthetic", "dataset.shape=[1,4,4]", "dataset.size=40", "dataset.batch_size=4",
                          "model=mlp"],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_empty_share_counts_nothing_and_moves_nothing(tmp_path: Path, kind: str) -> None:
    engine = Engine(compose([*SHARES, *KINDS[kind]], tmp_path))
    loader = engine.train_loader  # what it collates for a rank given no index of the last batch
    stand_in = loader.collate_fn(loader.dataset.__getitems__([]) if hasattr(loader.dataset, "__getitems__") else [])
    assert isinstance(stand_in, EmptyShare)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    grads = {}
    step = engine.precision.step
    engine.precision.step = lambda opt: (grads.update({n: p.grad.clone() for n, p in engine.module.named_parameters()
                                                       if p.grad is not None}), step(opt))[1]
    loss_sum, count, _ = engine.train_step([stand_in])
    assert count == 0 and loss_sum.item() == 0.0
    # every parameter got a gradient (DDP reduces them all) and every one is exactly 0
    assert grads.keys() == {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert all(not g.any() for g in grads.values())
    for key, value in engine.module.state_dict().items():
        assert torch.equal(value, before[key]), key
    # evaluation: a split whose only batch is a stand-in reports nothing but the sums of 0 samples
    engine.eval_loaders["val"] = [stand_in, *engine.eval_loaders["val"]]
    with_stand_in = engine.evaluate("val")
    engine.eval_loaders["val"] = engine.eval_loaders["val"][1:]
    assert with_stand_in == engine.evaluate("val")


def test_labels_reach_a_model_with_tuple_batches_and_a_plain_dict_output_is_read(tmp_path: Path) -> None:
    """The model's own loss is trained when it returns no logits, whatever the batch layout; a model
    that returns logits too (as HuggingFace's do) is trained on the task's loss, label smoothing applied."""
    own = Engine(compose([*SHARES, OWN_LOSS, "trainer.log_every_n_steps=1"], tmp_path / "own"))
    x, y = next(iter(own.train_loader))
    expected = own.module(x, labels=y)["loss"].item()
    own.fit()
    assert own.monitor.history["train/loss"][0][1] == pytest.approx(expected, rel=1e-6)
    both = [*SHARES, OWN_LOSS, "+model.returns=logits_and_loss", "trainer.log_every_n_steps=1",
            "task.label_smoothing=0.2"]
    engine = Engine(compose(both, tmp_path / "both"))
    x, y = next(iter(engine.train_loader))
    task_loss = torch.nn.functional.cross_entropy(engine.module(x)["logits"], y, label_smoothing=0.2).item()
    engine.fit()
    assert engine.monitor.history["train/loss"][0][1] == pytest.approx(task_loss, rel=1e-6)


def test_label_smoothing_is_refused_for_a_model_that_computes_its_own_loss(tmp_path: Path) -> None:
    from runner.specs.run import SpecError

    with pytest.raises(SpecError) as err:
        Engine(compose([*SHARES, OWN_LOSS, "task.label_smoothing=0.1"], tmp_path))
    assert str(err.value) == ("task.label_smoothing: 0.1 cannot apply: tests.user_pkg.shares.OwnLossNet returns its own "
                              "loss and no logits, so the task does not compute the loss; remove task.label_smoothing, "
                              "or return logits from the model")


def test_label_smoothing_is_refused_for_such_a_model_built_on_the_meta_device_too() -> None:
    """A sharded run builds its model on the meta device and checks on a meta copy of the stand-in batch: before,
    the copy kept the batch's CPU tensors (a Batch was one leaf to tree_map), the meta model could not run them
    and the check was skipped, so the refusal came at the first step, after every rank had started."""
    from runner.engine.engine import _check_loss_options
    from runner.specs.run import SpecError
    from runner.tasks import Batch
    from runner.tasks.classification import Classification
    from tests.user_pkg.shares import OwnLossNet

    with torch.device("meta"):
        model = OwnLossNet((4,), 3)
    stand_in = Batch({"features": torch.randn(2, 4)}, torch.tensor([0, 2]))
    with pytest.raises(SpecError, match=r"^task.label_smoothing: 0.1 cannot apply: OwnLossNet returns its own loss"):
        _check_loss_options(model, Classification(label_smoothing=0.1), stand_in, True, "OwnLossNet", on_meta=True)


def test_a_metric_the_task_does_not_declare_is_refused_and_directions_are_the_declared_ones() -> None:
    from runner.tasks import Task, direction, metric_values
    from tests.user_pkg.regression import R2Regression

    class Bleu(Task):
        def summarize(self, sums: dict, count: float) -> dict:
            return {"loss": sums["loss"] / count, "bleu": 0.3}

    with pytest.raises(ValueError, match="Bleu reports bleu but does not declare it in `metrics`"):
        metric_values(Bleu(), {"loss": 2.0}, 2, "val")
    assert direction(R2Regression, "val/r2") == "maximize" and direction(R2Regression, "test/loss") == "minimize"
    Bleu.metrics = {"loss": "minimize", "bleu": "maximize"}
    assert metric_values(Bleu(), {"loss": 2.0}, 2, "val") == {"val/loss": 1.0, "val/bleu": 0.3}


def test_label_smoothing_applies_to_a_huggingface_model_the_task_computes_the_loss_of(tmp_path: Path) -> None:
    """A HuggingFace model given labels returns its own loss next to its logits: the task's (smoothed)
    loss is the one trained, not the model's (which ignored task.label_smoothing)."""
    engine = Engine(compose(["task=language_modeling", "dataset=padded_tokens", "model=hf", "model.task=causal_lm",
                             "model.architecture=gpt2",
                             "+model.config={n_layer: 1, n_embd: 16, n_head: 2, resid_pdrop: 0, embd_pdrop: 0, attn_pdrop: 0}",
                             "task.label_smoothing=0.2", "trainer.max_steps=1", "trainer.log_every_n_steps=1",
                             "trainer.eval_every_epoch=false", "trainer.progress_bar=off"], tmp_path))
    engine.train_loader.batch_sampler.set_epoch(0)
    batch = next(iter(engine.train_loader))
    output = engine.module(input_ids=batch["input_ids"], labels=batch["labels"])
    smoothed = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), batch["labels"].flatten(),
                                                 ignore_index=-100, label_smoothing=0.2).item()
    assert abs(smoothed - output.loss.item()) > 1e-3  # the model's own loss differs: the check has power
    engine.fit()
    assert engine.monitor.history["train/loss"][0][1] == pytest.approx(smoothed, rel=1e-5)


def test_counts_kept_on_the_device_train_evaluate_and_checkpoint_as_ints_do(tmp_path: Path, monkeypatch) -> None:
    """Labels on a GPU give 0-dim tensor counts (reading them each step would stall the GPU): the logged
    train/loss, throughput units, validation and test metrics and the checkpointed window equal an int run's."""
    import runner.tasks.classification as classification

    overrides = ["trainer.max_steps=6", "trainer.log_every_n_steps=2", "trainer.eval_every_n_steps=3",
                 "trainer.eval_every_epoch=false", "trainer.progress_bar=off", "dataset.batch_size=32"]
    as_int = Engine(compose(overrides, tmp_path / "int"))
    ints = as_int.fit()
    kept = classification.units_kept
    seen = []
    monkeypatch.setattr(classification, "units_kept", lambda labels: seen.append(1) or (labels != -100).sum())
    as_tensor = Engine(compose(overrides, tmp_path / "tensor"))
    tensors = as_tensor.fit()
    assert seen and kept is not classification.units_kept
    assert as_tensor.monitor.history == as_int.monitor.history | {
        k: v for k, v in as_tensor.monitor.history.items() if k.startswith("throughput/") or k == "compile/seconds"}
    assert tensors.final == ints.final and tensors.best == ints.best
    assert as_tensor.monitor.samples_seen == as_int.monitor.samples_seen == 6 * 32
    window = as_tensor.monitor.window.state_dict()
    assert all(type(c) is int for c in window["counts"]) and type(window["untimed"]) is int


@pytest.mark.parametrize("shape", [(64,), (512,), (513,), (4, 8)])
def test_units_kept_counted_in_python_equals_the_tensor_count(shape: tuple[int, ...]) -> None:
    """A small CPU batch's labels are counted from a list (runner/tasks units_kept), a larger or 2-D one by
    tensor ops: both give exactly the labels that are not IGNORE, as an int."""
    from runner.tasks import IGNORE, units_kept

    labels = torch.randint(0, 10, shape)
    labels.view(-1)[::3] = IGNORE
    kept = units_kept(labels)
    assert type(kept) is int and kept == int((labels != IGNORE).sum()) == labels.numel() - len(labels.view(-1)[::3])
    assert units_kept(torch.full(shape, IGNORE)) == 0


def test_a_micro_batchs_units_are_its_length_only_where_no_label_of_the_split_is_ignored() -> None:
    """The engine decides the unit count once (runner/engine/engine.py _unit_count): the length for a classification
    tensor dataset of class ids none of which is IGNORE; the task's own count where one is, for soft labels, for a
    dataset read through a collate, and for another task."""
    from torch.utils.data import TensorDataset

    from runner.engine.engine import _unit_count
    from runner.engine.loader import BatchedTensors
    from runner.tasks import IGNORE
    from runner.tasks.classification import Classification
    from runner.tasks.language_modeling import LanguageModeling

    task, inputs = Classification(num_classes=3), torch.zeros(6, 2)
    ids = torch.tensor([0, 1, 2, 0, 1, 2])
    length = _unit_count(task, BatchedTensors(TensorDataset(inputs, ids)))
    assert length != task.count and length(ids[:4]) == 4 and type(length(ids[:4])) is int
    some_ignored = torch.tensor([0, IGNORE, 2, 0, IGNORE, 2])
    count = _unit_count(task, BatchedTensors(TensorDataset(inputs, some_ignored)))
    assert count == task.count and count(some_ignored[:4]) == 3 and count(some_ignored) == 4
    assert _unit_count(task, BatchedTensors(TensorDataset(inputs, torch.rand(6, 3)))) == task.count  # soft labels
    assert _unit_count(task, TensorDataset(inputs, ids)) == task.count  # read through a collate
    lm = LanguageModeling()
    assert _unit_count(lm, BatchedTensors(TensorDataset(inputs, ids))) == lm.count
