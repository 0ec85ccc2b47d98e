"""Activation checkpointing: the same loss, gradients and BatchNorm statistics as without, to the bit (CPU, fp32)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from runner.engine import activation_checkpointing
from runner.engine.engine import Engine
from runner.models.cnn import CNN
from runner.models.gpt import GPT
from runner.specs.run import SpecError
from tests.test_open_world import LM, compose
from tests.user_pkg.blocks import Flat, Tower


def _step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, mode: str):
    model = activation_checkpointing.apply(copy.deepcopy(model), mode)
    torch.manual_seed(7)  # dropout draws the same masks in every mode
    out = model(inputs)
    loss = torch.nn.functional.cross_entropy(out.flatten(0, -2), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, {n: b.clone() for n, b in model.named_buffers()}


MODELS = {
    "gpt with dropout": lambda: (GPT(vocab_size=50, max_length=16, n_layer=3, n_head=2, n_embd=16, dropout=0.1),
                                 torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))),
    "a user's blocks (tests/user_pkg)": lambda: (Tower((1, 8, 8), 10, hidden=16), torch.randn(6, 1, 8, 8),
                                                 torch.randint(0, 10, (6,))),
    "cnn with BatchNorm": lambda: (CNN((1, 8, 8), 10, channels=[4, 8], dropout=0.2, norm=True), torch.randn(6, 1, 8, 8),
                                   torch.randint(0, 10, (6,))),
}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", list(MODELS))
def test_checkpointing_gives_the_same_loss_gradients_and_statistics_to_the_bit(name: str, mode: str) -> None:
    torch.manual_seed(0)
    model, inputs, targets = MODELS[name]()
    loss, grads, buffers = _step(model, inputs, targets, "none")
    loss_ac, grads_ac, buffers_ac = _step(model, inputs, targets, mode)
    assert torch.equal(loss, loss_ac)
    assert grads.keys() == grads_ac.keys() and all(torch.equal(grads[n], grads_ac[n]) for n in grads)
    # BatchNorm's running statistics move once per forward, not again when a block is recomputed
    assert buffers.keys() == buffers_ac.keys() and all(torch.equal(buffers[n], buffers_ac[n]) for n in buffers)


def test_checkpointing_recomputes_and_keeps_parameter_names() -> None:
    model = GPT(vocab_size=50, max_length=16, n_layer=3, n_head=2, n_embd=16)
    names = list(model.state_dict())
    activation_checkpointing.apply(model, "full")
    assert len(activation_checkpointing.checkpointed_blocks(model)) == 3 and list(model.state_dict()) == names
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
    model(torch.randint(0, 50, (2, 16))).sum().backward()
    assert len(calls) == 2  # the forward, then its recomputation in the backward pass


def test_a_model_without_blocks_is_refused_naming_the_key() -> None:
    with pytest.raises(SpecError) as e:
        activation_checkpointing.apply(Flat((1, 8, 8), 10), "full")  # a user's model of plain attributes
    assert str(e.value) == ("trainer.activation_checkpointing: full found no repeated blocks in Flat (no child module "
                            "with parameters in a Sequential or ModuleList); use trainer.activation_checkpointing=none")


def test_a_run_with_accumulation_trains_the_same_weights_to_the_bit(tmp_path: Path) -> None:
    """Through the engine: language modelling with padded tokens, two micro-batches per step, dropout."""
    common = [*LM, "+accum=2", "model.dropout=0.1", "trainer.max_steps=2", "trainer.eval_every_epoch=false"]
    weights = {}
    for mode in ("none", "full"):  # selective's own: the module-level test above
        engine = Engine(compose([*common, f"trainer.activation_checkpointing={mode}"], tmp_path / mode))
        engine.fit()
        weights[mode] = engine.module.state_dict()
    assert all(torch.equal(weights["none"][k], weights["full"][k]) for k in weights["none"])


@pytest.mark.slow  # compiling costs tens of seconds on a CPU; in CI the eager runs above keep the property
@pytest.mark.parametrize("model", [LM, ["model=cnn", "model.norm=true", "model.channels=[4,8]", "trainer.progress_bar=off"]],
                         ids=["gpt", "cnn with BatchNorm"])
def test_a_compiled_run_with_checkpointing_trains_like_one_without(tmp_path: Path, model: list[str]) -> None:
    common = [*model, "+accum=2", "trainer.max_steps=3", "trainer.compile=true", "trainer.eval_every_epoch=false"]
    weights = {}
    for mode in ("none", "selective", "full"):
        engine = Engine(compose([*common, f"trainer.activation_checkpointing={mode}"], tmp_path / mode))
        engine.fit()
        weights[mode] = engine.module.state_dict()
    for mode in ("selective", "full"):  # BatchNorm's statistics included: moved once per step
        for key in weights["none"]:
            torch.testing.assert_close(weights[mode][key], weights["none"][key], rtol=1e-5, atol=1e-6, msg=key)
