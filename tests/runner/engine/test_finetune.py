"""runner/engine/finetune.py: weights loading, freezing, gradual unfreezing and lr multipliers, on real models and optimizers."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from runner.engine import checkpoint
from runner.engine.monitor import learning_rates
from runner.engine.finetune import LoadReport, Unfreezer, freeze, load_weights, lr_multiplier_groups
from runner.engine.schedule import build_scheduler
from runner.specs.run import SpecError
from runner.specs.scheduler import SchedulerSpec


class Net(nn.Module):
    def __init__(self, classes: int = 10, seed: int = 0):
        torch.manual_seed(seed)
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def same(a: nn.Module, b: nn.Module, prefix: str = "") -> list[str]:
    """Names of the parameters under `prefix` that hold equal values in a and b."""
    other = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if n.startswith(prefix) and torch.equal(p, other[n])]


def test_loads_a_safetensors_file(tmp_path: Path) -> None:
    source, target = Net(seed=1), Net(seed=2)
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    report = load_weights(target, str(tmp_path / "w.safetensors"))
    assert len(same(source, target)) == 8
    assert (len(report.loaded), report.reinitialised, report.missing, report.unexpected) == (8, [], [], [])
    assert report.describe() == f"loaded 8 tensors from {tmp_path / 'w.safetensors'}"


@pytest.mark.parametrize("give", ["file", "run_dir"])
def test_loads_the_model_of_a_runner_checkpoint(tmp_path: Path, give: str) -> None:
    source, target = Net(seed=1), Net(seed=2)
    opt = torch.optim.AdamW(source.parameters())
    path = checkpoint.save(tmp_path / "run" / "checkpoints", 7, {"model": source.state_dict(), "optimizer": opt.state_dict(),
                                                                "spec": "seed: 1\n"}, keep=1)
    report = load_weights(target, str(path if give == "file" else tmp_path / "run"))
    assert len(report.loaded) == 8 and len(same(source, target)) == 8


@pytest.mark.parametrize("wrap", [lambda sd: sd, lambda sd: {"state_dict": sd, "epoch": 3}, lambda sd: {"model": sd}])
def test_loads_a_torch_state_dict_file(tmp_path: Path, wrap) -> None:
    source, target = Net(seed=1), Net(seed=2)
    torch.save(wrap(source.state_dict()), tmp_path / "w.pt")
    load_weights(target, str(tmp_path / "w.pt"))
    assert len(same(source, target)) == 8


def test_a_head_of_another_shape_keeps_its_fresh_init_and_is_reported(tmp_path: Path) -> None:
    source, target = Net(classes=10, seed=1), Net(classes=2, seed=2)
    fresh_head = target.head.weight.detach().clone()
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    report = load_weights(target, str(tmp_path / "w.safetensors"))
    assert len(same(source, target, "backbone.")) == 6
    assert torch.equal(target.head.weight, fresh_head)
    assert report.reinitialised == [("head.weight", (10, 16), (2, 16)), ("head.bias", (10,), (2,))]
    assert report.describe() == (f"loaded 6 tensors from {tmp_path / 'w.safetensors'}; re-initialised head.weight "
                                 "(shape [10, 16] in the file, [2, 16] here), head.bias (shape [10] in the file, [2] here)")


def test_wrapper_prefixes_are_stripped(tmp_path: Path) -> None:
    source, target = Net(seed=1), Net(seed=2)
    save_file({f"module._orig_mod.{k}": v for k, v in source.state_dict().items()}, tmp_path / "w.safetensors")
    report = load_weights(target, str(tmp_path / "w.safetensors"))
    assert len(same(source, target)) == 8
    assert report.renamed == "stripped 'module._orig_mod.'"
    assert "(stripped 'module._orig_mod.')" in report.describe()


def test_missing_and_unexpected_names_are_reported_on_a_second_line(tmp_path: Path) -> None:
    source, target = Net(seed=1), Net(seed=2)
    state = {k: v for k, v in source.state_dict().items() if k != "backbone.3.bias"}
    state["extra.scale"] = torch.ones(3)
    save_file(state, tmp_path / "w.safetensors")
    report = load_weights(target, str(tmp_path / "w.safetensors"))
    assert len(same(source, target)) == 7
    assert report.describe().splitlines()[1] == "missing: backbone.3.bias; unexpected: extra.scale"


def test_hf_save_pretrained_weights_load_into_the_hf_wrapper(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from runner.models.hf import hf_model

    tiny = dict(config={"dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 64}, vocab_size=40, max_length=8,
                pad_token_id=0)
    torch.manual_seed(1)
    source = hf_model(num_classes=4, **tiny)
    source.model.save_pretrained(tmp_path / "hf")  # HF's names: distilbert.*, pre_classifier.*, classifier.*
    torch.manual_seed(2)
    target = hf_model(num_classes=2, **tiny)
    report = load_weights(target, str(tmp_path / "hf"))  # the directory's model.safetensors
    assert report.renamed == "added 'model.'"
    assert [n for n, _, _ in report.reinitialised] == ["model.classifier.weight", "model.classifier.bias"]
    assert report.missing == [] and report.unexpected == []
    assert len(same(source, target, "model.distilbert.")) == len([n for n, _ in target.named_parameters()
                                                                   if n.startswith("model.distilbert.")])


def test_tied_weights_saved_once_are_not_missing(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

    torch.manual_seed(1)
    source = Tied()
    save_file({"embed.weight": source.embed.weight.detach()}, tmp_path / "w.safetensors")
    target = Tied()
    report = load_weights(target, str(tmp_path / "w.safetensors"))
    assert report.missing == [] and torch.equal(target.out.weight, source.embed.weight)


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "run").mkdir()
    (tmp / "text.txt").write_text("not weights at all, only words")
    torch.save({"args": argparse.Namespace(lr=1)}, tmp / "object.pt")
    torch.save([torch.ones(2)], tmp / "list.pt")
    save_file({"other.weight": torch.ones(2)}, tmp / "foreign.safetensors")
    path = checkpoint.save(tmp / "ckpt", 1, {"model": Net().state_dict()}, keep=1)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    (tmp / "corrupt.pt").write_bytes(bytes(data))
    return {
        "missing": (tmp / "nope.safetensors", "does not exist"),
        "empty run dir": (tmp / "run", "no checkpoint in"),
        "text": (tmp / "text.txt", "is not a weights file (unknown format)"),
        "object": (tmp / "object.pt", "holds objects other than tensors and plain containers"),
        "list": (tmp / "list.pt", "holds no state dict (a list)"),
        "foreign": (tmp / "foreign.safetensors", "none of the 1 tensors in"),
        "corrupt": (tmp / "corrupt.pt", "is not a valid runner checkpoint (checksum mismatch"),
    }


@pytest.mark.parametrize("case", ["missing", "empty run dir", "text", "object", "list", "foreign", "corrupt"])
def test_a_bad_weights_file_fails_in_one_line_naming_model_weights(tmp_path: Path, case: str) -> None:
    path, reason = _bad_files(tmp_path)[case]
    target = Net(seed=2)
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(SpecError) as info:
        load_weights(target, str(path))
    message = str(info.value)
    assert message.startswith("model.weights: ") and reason in message and "\n" not in message, message
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))  # nothing half-loaded


# --- freezing --------------------------------------------------------------------------------------

def train_epoch(model: Net, opt: torch.optim.Optimizer, seed: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad(set_to_none=True)  # a frozen parameter keeps grad None, so optimizers skip it
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_freeze_keeps_matching_parameters_unchanged_under_adamw_with_weight_decay() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    frozen = freeze(model, ["backbone.0.*", "backbone.1.weight"])
    assert frozen == ["backbone.0.weight", "backbone.0.bias", "backbone.1.weight"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_epoch(model, opt, seed=0)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == frozen


def test_a_freeze_pattern_matching_nothing_is_named() -> None:
    with pytest.raises(ValueError, match=r"^freeze pattern 'encoder\.\*' matches no parameter; names look like "
                                         r"backbone\.0\.weight, backbone\.0\.bias, backbone\.1\.weight and 5 more$"):
        freeze(Net(), ["backbone.*", "encoder.*"])


def test_unfreezing_needs_no_new_optimizer_and_adam_state_starts_then() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)  # built while everything is trainable
    unfreezer = Unfreezer(model, ["backbone.*"], unfreeze_after_epochs=2)
    first = model.backbone[0].weight
    start = first.detach().clone()
    for epoch in range(4):
        unfrozen = unfreezer.on_epoch_start(epoch)
        assert unfrozen == ([] if epoch != 2 else [f"backbone.{i}.{k}" for i in (0, 1, 3) for k in ("weight", "bias")])
        train_epoch(model, opt, seed=epoch)
        if epoch < 2:
            assert torch.equal(first, start) and first not in opt.state
            assert model.head.weight in opt.state
    assert not torch.equal(first, start)
    assert int(opt.state[first]["step"]) == 2 * 3  # Adam's moments and bias correction began at the unfreeze
    assert int(opt.state[model.head.weight]["step"]) == 4 * 3


@pytest.mark.parametrize("stop_after", [1, 3])  # resumed while frozen, and after the unfreeze
def test_a_resumed_run_matches_an_uninterrupted_one(stop_after: int) -> None:
    def fresh() -> tuple[Net, torch.optim.Optimizer, Unfreezer]:
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, opt, Unfreezer(model, ["backbone.*"], unfreeze_after_epochs=2)

    def epochs(model, opt, unfreezer, span) -> None:
        for epoch in span:
            unfreezer.on_epoch_start(epoch)
            train_epoch(model, opt, seed=epoch)

    whole = fresh()
    epochs(*whole, range(5))
    first = fresh()
    epochs(*first, range(stop_after))
    saved = {"model": first[0].state_dict(), "opt": first[1].state_dict(), "unfreezer": first[2].state_dict()}
    second = fresh()  # a new process: everything frozen again until the state says otherwise
    second[0].load_state_dict(saved["model"])
    second[1].load_state_dict(saved["opt"])
    second[2].load_state_dict(saved["unfreezer"])
    assert second[0].backbone[0].weight.requires_grad == (stop_after > 2)
    epochs(*second, range(stop_after, 5))
    assert len(same(whole[0], second[0])) == 8


def test_unfreezer_refuses_a_state_of_other_parameters() -> None:
    state = Unfreezer(Net(), ["backbone.0.*"], 1).state_dict()
    with pytest.raises(ValueError, match="the checkpoint froze other parameters"):
        Unfreezer(Net(), ["backbone.*"], 1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^unfreeze_after_epochs: -1 is not allowed"):
        Unfreezer(Net(), ["backbone.*"], -1)


class NormNet(nn.Module):
    """A backbone with BatchNorm (affine, and one without parameters) and a head."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.BatchNorm1d(16, affine=False))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))]


def test_frozen_batchnorm_keeps_its_running_statistics_until_unfrozen() -> None:
    model = NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    unfreezer = Unfreezer(model, ["backbone.*"], unfreeze_after_epochs=1)
    start = running_stats(model)
    for epoch in range(2):
        unfreezer.on_epoch_start(epoch)
        model.eval()
        model.train()  # as the engine does after each evaluation
        train_epoch(model, opt, seed=epoch)
        if epoch == 0:  # frozen: bitwise the statistics it started with, and the layers say eval
            assert all(torch.equal(a, b) for a, b in zip(running_stats(model), start))
            assert model.training and not model.backbone[1].training and not model.backbone[3].training
    moved = running_stats(model)
    assert all(not torch.equal(a, b) for a, b in zip(moved, start))  # unfrozen: both layers update again
    assert model.backbone[1].training and model.backbone[3].training


def test_a_frozen_head_norm_is_held_and_a_resumed_unfreezer_holds_it_again() -> None:
    model = NormNet()
    freeze(model, ["backbone.0.*", "backbone.1.*"])  # the parameterless norm (backbone.3) stays trainable
    train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1), seed=0)
    assert not model.backbone[1].training and model.backbone[3].training
    assert torch.equal(model.backbone[1].running_mean, torch.zeros(16))
    state = Unfreezer(NormNet(), ["backbone.*"], 1).state_dict()
    resumed = NormNet()
    unfreezer = Unfreezer(resumed, ["backbone.*"], 1)
    unfreezer.load_state_dict({**state, "unfrozen": True})
    resumed.train()
    assert resumed.backbone[1].training
    unfreezer.load_state_dict(state)
    resumed.train()
    assert not resumed.backbone[1].training


def test_weights_that_fill_less_than_half_of_the_model_are_refused(tmp_path: Path) -> None:
    target = Net(seed=2)
    before = [p.detach().clone() for p in target.parameters()]
    # the same names, other widths: another architecture's file (8 -> 32 -> 10 instead of 8 -> 16 -> 10)
    other = {n: torch.zeros([32 if d == 16 else d for d in p.shape]) for n, p in target.state_dict().items()}
    other["head.weight"], other["head.bias"] = torch.zeros(10, 16), torch.zeros(10)
    save_file(other, tmp_path / "w.safetensors")
    with pytest.raises(SpecError) as info:
        load_weights(target, str(tmp_path / "w.safetensors"))
    assert str(info.value) == (f"model.weights: {tmp_path / 'w.safetensors'} fills 28% of this model's values (170 of "
                               "618; 2 tensors fit, 6 have another shape, 0 are not in the file); at least 50% must "
                               "load: these look like the weights of another architecture")
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))


# --- discriminative learning rates -------------------------------------------------------------------

def test_lr_groups_split_by_the_first_matching_pattern() -> None:
    model = Net()
    groups = lr_multiplier_groups(list(model.named_parameters()),
                                  {"backbone.0.*": 0.01, "backbone.*": 0.1, "head.bias": 1.0})
    assert [(m, [n for n, _ in ps]) for m, ps in groups] == [
        (0.01, ["backbone.0.weight", "backbone.0.bias"]),
        (0.1, ["backbone.1.weight", "backbone.1.bias", "backbone.3.weight", "backbone.3.bias"]),
        (1.0, ["head.weight", "head.bias"]),  # a pattern's 1.0 and the default share a group
    ]


@pytest.mark.parametrize("scheduler", [SchedulerSpec("runner.engine.schedule.cosine", warmup=3),
                                       SchedulerSpec("runner.engine.schedule.onecycle"), SchedulerSpec("runner.engine.schedule.wsd", warmup=2)])
def test_each_groups_lr_is_base_times_multiplier_and_schedules_keep_the_ratio(scheduler: SchedulerSpec) -> None:
    model = Net()
    groups = lr_multiplier_groups(list(model.named_parameters()), {"backbone.*": 0.1})
    opt = torch.optim.AdamW([{"params": [p for _, p in ps], "lr": 0.02 * m} for m, ps in groups], lr=0.02)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.002), 0.02]
    schedule = build_scheduler(scheduler, opt, total_steps=10)
    lrs = []
    for _ in range(10):
        train_epoch(model, opt, seed=0, steps=1)
        schedule.step()
        lrs.append((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
    assert [low for low, _ in lrs] == pytest.approx([0.1 * base for _, base in lrs], abs=1e-12)
    assert len({round(base, 10) for _, base in lrs}) >= 4  # the schedule did move the lr


@pytest.mark.parametrize(("multipliers", "message"), [
    ({"encoder.*": 0.1}, r"^lr multiplier pattern 'encoder\.\*' matches no parameter; names look like backbone"),
    ({"backbone.*": 0.1, "backbone.0.*": 0.01},
     r"^lr multiplier pattern 'backbone\.0\.\*' matches only parameters an earlier pattern took"),
    ({"head.*": -1.0}, r"^lr multiplier for 'head\.\*': -1\.0 is not allowed; allowed: a number >= 0$"),
])
def test_bad_lr_multipliers_are_named(multipliers: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lr_multiplier_groups(list(Net().named_parameters()), multipliers)


def test_load_report_lists_many_names_briefly() -> None:
    report = LoadReport(path="w.pt", loaded=["a"], missing=[f"m{i}" for i in range(10)])
    assert report.describe() == "loaded 1 tensors from w.pt\nmissing: m0, m1, m2, m3, m4, m5 and 4 more"


# --- through the engine: the keys a run spec gives (model.weights, model.freeze, optimizer.lr_multipliers) -----

def _engine(overrides: list[str], run_dir):
    from runner.engine.engine import Engine
    from tests.conftest import compose_spec

    return Engine(compose_spec(["trainer.progress_bar=off", "model.hidden=[32]", *overrides], run_dir))


def test_a_run_starts_from_another_runs_weights_with_its_head_reinitialised(tmp_path) -> None:
    source = _engine(["trainer.max_steps=5", "trainer.eval_every_epoch=false"], tmp_path / "source")
    source.fit()
    ckpt = tmp_path / "source" / "checkpoints" / "last.pt"
    # synthetic 8x8 inputs with 4 classes: the body fits, the 10-class head does not
    target = _engine(["dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.num_classes=4", "dataset.size=400",
                      f"model.weights={ckpt}"], tmp_path / "target")
    assert torch.equal(target.module[1].weight, source.module[1].weight)
    assert target.module[3].weight.shape == (4, 32)  # the head: fresh, the size of this task


def test_frozen_parameters_stay_and_unfreeze_at_the_epoch_asked_exactly_on_resume(tmp_path) -> None:
    common = ["trainer.max_epochs=3", "model.freeze=[1.*]", "model.unfreeze_after_epochs=1",
              "trainer.checkpoint_every_n_steps=5", "trainer.keep_checkpoints=20", "trainer.eval_every_epoch=false"]
    full = _engine(common, tmp_path / "full")
    start = full.module[1].weight.detach().clone()
    full.train_step = _recording(full, start)
    full.fit()
    assert full.frozen_steps == full.steps_per_epoch  # untouched through epoch 0, trained from epoch 1 on
    assert not torch.equal(full.module[1].weight, start)
    resumed = _engine([*common, f"trainer.resume={tmp_path / 'full' / 'checkpoints' / 'step-00000010.pt'}"],
                      tmp_path / "resumed")  # step 10: before the unfreeze (20 steps per epoch)
    resumed.fit()
    for a, b in zip(full.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


def test_a_frozen_batchnorm_block_of_a_run_keeps_its_statistics_and_trains_them_once_unfrozen(tmp_path) -> None:
    # cnn: 0 conv, 1 BatchNorm, ...; epoch 0 frozen, epoch 1 trainable
    from runner.engine.engine import Engine
    from tests.conftest import compose_spec

    engine = Engine(compose_spec(["trainer.progress_bar=off", "model=cnn", "model.channels=[8,8]", "model.freeze=[0.*,1.*]",
                                  "model.unfreeze_after_epochs=1", "trainer.max_epochs=2", "dataset.batch_size=512",
                                  "trainer.eval_every_n_steps=2"], tmp_path))
    norm = engine.module[1]
    start = (norm.running_mean.clone(), norm.running_var.clone(), norm.weight.detach().clone())
    step = engine.train_step
    seen = []

    def record(batches):
        out = step(batches)
        seen.append(all(torch.equal(a, b) for a, b in zip((norm.running_mean, norm.running_var, norm.weight), start)))
        return out

    engine.train_step = record
    engine.fit()
    per_epoch = engine.steps_per_epoch
    assert seen[:per_epoch] == [True] * per_epoch  # evaluations in between: model.train() does not wake it
    assert not any(seen[per_epoch:])


def _recording(engine, start):
    step = engine.train_step
    engine.frozen_steps = 0

    def record(batches):
        out = step(batches)
        engine.frozen_steps += torch.equal(engine.module[1].weight, start)
        return out

    return record


def test_lr_multipliers_scale_the_matching_groups_and_the_logged_lr_stays_the_base(tmp_path) -> None:
    engine = _engine(["optimizer=adamw", "optimizer.lr=0.01", "optimizer.lr_multipliers={1.*: 0.1}"], tmp_path / "run")
    lrs = sorted({round(g["lr"], 6) for g in engine.optimizer.param_groups})
    assert lrs == [0.001, 0.01] and learning_rates(engine.optimizer)["lr"] == pytest.approx(0.01)
    from runner.specs.run import SpecError

    with pytest.raises(SpecError, match=r"^model.freeze: .*nothing\*"):
        _engine(["model.freeze=[nothing*]"], tmp_path / "bad")
