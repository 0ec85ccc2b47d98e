"""runner/engine/optim.py: every option learns, weight-decay grouping, kernel choice, Muon routing, checkpoints."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import io

import pytest
import torch
import yaml
from torch import nn

from runner.specs import registry
from runner.specs.components import load_target
from runner.engine.optim import build_optimizer, kernel_kwargs, kernels
from runner.specs.optimizer import OptimizerSpec
from runner.specs.run import SpecError

CPU = torch.device("cpu")
NAMES = registry.options("optimizer")


def spec_of(name: str, **changes) -> OptimizerSpec:
    """The spec conf/optimizer/<name>.yaml composes to, with changes."""
    data = yaml.safe_load((registry.CONF_DIR / "optimizer" / f"{name}.yaml").read_text())
    return OptimizerSpec.parse({**data, **changes})


def cls_of(name: str) -> type:
    return load_target("optimizer", spec_of(name).target)


def tiny_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # how checkpoints are read back


def test_the_options_are_the_eight_documented():
    assert set(NAMES) == {"sgd", "adam", "adamw", "lamb", "rmsprop", "adagrad", "muon", "adafactor"}


@pytest.mark.parametrize("name", NAMES)
def test_yaml_names_its_class_and_only_keys_it_takes(name):
    path = registry.CONF_DIR / "optimizer" / f"{name}.yaml"
    assert path.read_text().startswith("# "), "each option starts with a one-line comment saying what it is"
    data = yaml.safe_load(path.read_text())
    spec = OptimizerSpec.parse(data)
    runner_keys = {f.name for f in dataclasses.fields(OptimizerSpec)} - {"target", "params"}
    assert set(spec.params) == set(data) - runner_keys - {"_target_"}
    assert set(spec.params) <= set(inspect.signature(cls_of(name)).parameters)


def learn(optimizer: torch.optim.Optimizer, model: nn.Module, steps: int) -> list[float]:
    """Full-batch steps on a learnable problem (labels from a random linear teacher); the losses."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_learns(name):
    """60 steps at lr 0.01 bring the loss below half of an untrained model's (ln 3 = 1.10): the slowest
    here (sgd) reaches 0.50, an optimizer that did not step would stay at 1.12."""
    model = tiny_model()
    losses = learn(build_optimizer(spec_of(name, lr=0.01), model, CPU), model, 60)
    assert losses[-1] < 0.5 * losses[0], losses


def test_biases_and_norm_weights_are_not_decayed():
    model = tiny_model()
    optimizer = build_optimizer(spec_of("adamw", weight_decay=0.1), model, CPU)
    decay, no_decay = optimizer.param_groups
    matrices = {id(model[i].weight) for i in (0, 3, 5)}
    assert decay["weight_decay"] == 0.1 and {id(p) for p in decay["params"]} == matrices
    assert no_decay["weight_decay"] == 0.0
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in model.parameters()} - matrices


def test_decay_norm_and_bias_decays_everything():
    model = tiny_model()
    optimizer = build_optimizer(spec_of("adamw", weight_decay=0.1, decay_norm_and_bias=True), model, CPU)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1]
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_frozen_parameters_and_the_models_no_weight_decay_list():
    class WithPosEmbed(nn.Module):  # the timm convention: no_weight_decay() names parameters to spare
        def __init__(self) -> None:
            super().__init__()
            self.pos_embed = nn.Parameter(torch.zeros(1, 4, 8))
            self.proj = nn.Linear(8, 8)
            self.frozen = nn.Linear(8, 8).requires_grad_(False)

        def no_weight_decay(self) -> set[str]:
            return {"pos_embed"}

    model = WithPosEmbed()
    decay, no_decay = build_optimizer(spec_of("adamw"), model, CPU).param_groups
    assert [id(p) for p in decay["params"]] == [id(model.proj.weight)]
    assert {id(p) for p in no_decay["params"]} == {id(model.pos_embed), id(model.proj.bias)}


def test_muon_leaves_embeddings_head_and_vectors_to_adamw():
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 32))
    optimizer = build_optimizer(spec_of("muon"), model, CPU)
    tokens = torch.randint(0, 32, (4, 8))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    routed = {name: optimizer.state[p]["use_muon"] for name, p in model.named_parameters()}
    assert routed == {"0.weight": False, "1.weight": True, "1.bias": False, "2.weight": False, "2.bias": False,
                      "3.weight": False, "3.bias": False}


def test_auto_picks_foreach_on_cpu():
    for name in NAMES:
        defaults = build_optimizer(spec_of(name, impl="auto"), tiny_model(), CPU).defaults
        if "foreach" not in kernels(cls_of(name)):  # muon (and lamb on timm < 1.0.31): one implementation, no switch
            assert not defaults.get("foreach")
        else:
            assert defaults["foreach"] is True and not defaults.get("fused"), name


def test_auto_picks_fused_on_cuda_where_torch_has_it(monkeypatch):
    monkeypatch.setattr("runner.engine.optim.fused_kernel_runs", lambda cls, device_type: True)
    cuda = torch.device("cuda")
    assert {n: kernel_kwargs(cls_of(n), "auto", cuda) for n in NAMES} == {
        "sgd": {"fused": True}, "adam": {"fused": True}, "adamw": {"fused": True}, "adagrad": {"fused": True},
        "rmsprop": {"foreach": True}, "adafactor": {"foreach": True}, "muon": {},
        "lamb": {"foreach": True} if "foreach" in kernels(cls_of("lamb")) else {}}
    adagrad = cls_of("adagrad")
    monkeypatch.setattr("runner.engine.optim.fused_kernel_runs", lambda cls, device_type: cls is not adagrad)
    assert kernel_kwargs(adagrad, "auto", cuda) == {"foreach": True, "fused": False}  # older torch: CPU only
    with pytest.raises(SpecError, match=r"^optimizer\.impl: 'fused' is not available for Adagrad on cuda with torch"):
        kernel_kwargs(adagrad, "fused", cuda)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_steps_on_cuda_with_its_auto_kernel(name):
    cuda = torch.device("cuda")
    model = tiny_model().to(cuda)
    optimizer = build_optimizer(spec_of(name), model, cuda)
    if name in ("sgd", "adam", "adamw"):
        assert optimizer.defaults["fused"] is True
    loss = nn.functional.cross_entropy(model(torch.randn(4, 8, device=cuda)), torch.tensor([0, 1, 2, 0], device=cuda))
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    resumed = build_optimizer(spec_of(name), model, cuda)
    resumed.load_state_dict(round_trip(optimizer.state_dict()))
    assert resumed.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_forced_kernels():
    assert build_optimizer(spec_of("adamw", impl="fused"), tiny_model(), CPU).defaults["fused"] is True
    loop = build_optimizer(spec_of("adamw", impl="for_loop"), tiny_model(), CPU).defaults
    assert loop["foreach"] is False and loop["fused"] is False
    fused, loop = tiny_model(), tiny_model()
    learn(build_optimizer(spec_of("sgd", impl="fused"), fused, CPU), fused, 3)
    learn(build_optimizer(spec_of("sgd", impl="for_loop"), loop, CPU), loop, 3)
    for a, b in zip(fused.parameters(), loop.parameters()):
        torch.testing.assert_close(a, b)  # the forced fused kernel computes the same update
    assert not torch.equal(next(fused.parameters()), next(tiny_model().parameters()))  # and did step


@pytest.mark.parametrize("name", ["rmsprop", "adafactor", "lamb", "muon"])
def test_fused_on_an_optimizer_without_it_is_a_spec_error(name):
    with pytest.raises(SpecError, match=rf"^optimizer\.impl: 'fused' is not available for {cls_of(name).__name__}; choose one of auto"):
        build_optimizer(spec_of(name, impl="fused"), tiny_model(), CPU)


def test_muon_has_no_foreach_kernel():
    with pytest.raises(SpecError, match=r"optimizer\.impl: 'foreach' .* Muon; choose one of auto, for_loop"):
        build_optimizer(spec_of("muon", impl="foreach"), tiny_model(), CPU)


def test_nesterov_needs_momentum():
    with pytest.raises(SpecError, match=r"^optimizer\.nesterov: SGD refuses it \(Nesterov momentum requires a momentum"):
        build_optimizer(spec_of("sgd", nesterov=True, momentum=0.0), tiny_model(), CPU)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "muon"])
def test_kernels_compute_the_same_update(name):
    models = [tiny_model() for _ in range(2)]
    for impl, model in zip(("auto", "for_loop"), models):
        learn(build_optimizer(spec_of(name, impl=impl, weight_decay=0.01), model, CPU), model, 3)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trips_through_a_weights_only_load(name):
    spec = spec_of(name, weight_decay=0.01)
    model = tiny_model()
    optimizer = build_optimizer(spec, model, CPU)
    learn(optimizer, model, 3)
    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(spec, resumed_model, CPU)
    resumed.load_state_dict(round_trip(optimizer.state_dict()))
    # Resuming continues exactly as if never stopped.
    assert learn(resumed, resumed_model, 3) == learn(optimizer, model, 3)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("store")  # its tmp_path/mlflow.db comes migrated (tests/conftest.py): seconds saved
def test_a_zero_lr_multiplier_is_a_group_that_does_not_move(tmp_path):
    """optimizer.lr_multipliers={1.*: 0} (here the names themselves: a glob in an MLflow param key is another
    defect's): the first layer's parameters stay bitwise as initialised, the others train, and the logged lr
    is the base lr (it divided by the multiplier: ZeroDivisionError at step 1)."""
    from runner.engine.engine import Engine
    from runner.tracking.tracker import build_tracker
    from tests.conftest import compose_spec
    from tests.runner.engine.test_parallel import metric_history

    spec = compose_spec(["optimizer=adamw", "optimizer.lr=0.01", "optimizer.lr_multipliers={1.weight: 0, 1.bias: 0}",
                         "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.eval_every_epoch=false",
                         "trainer.progress_bar=off", "dataset.batch_size=16"], tmp_path / "run",
                        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    engine = Engine(spec, build_tracker(spec))
    start = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.fit()
    after = engine.module.state_dict()
    assert [k for k in start if torch.equal(start[k], after[k])] == ["1.weight", "1.bias"]
    assert {g["lr"] for g in engine.optimizer.param_groups} == {0.0, 0.01}
    assert metric_history(tmp_path / "mlflow.db")["lr"] == [(1, 0.01), (2, 0.01), (3, 0.01), (4, 0.01)]
