"""runner/models/gpt.py: shapes, causality, tied weights, GPT-2's parameter count, and that it learns."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.models.gpt import GPT


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields the tied weight once


def test_logits_have_batch_length_vocab_shape() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=50, max_length=16)
    logits = model(torch.randint(0, 50, (3, 11)), attention_mask=torch.ones(3, 11, dtype=torch.long))
    assert logits.shape == (3, 11, 50)
    assert torch.isfinite(logits).all()


def test_changing_token_t_changes_no_logit_before_t() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=40, max_length=12, size="mini").eval()
    ids = torch.randint(0, 40, (2, 12))
    changed = ids.clone()
    t = 7
    changed[:, t] = (changed[:, t] + 1) % 40
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])  # the change does reach position t onwards


def test_lm_head_shares_the_token_embedding_storage() -> None:
    model = GPT(vocab_size=30, max_length=8)
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()


# each backward pass's peak resident memory above its start, its model's lm head copying its gradient or not; every
# tensor of 64 KiB and more mapped and unmapped as it is made and freed, so that the peak is the tensors' own
_TIED_PEAKS = """
import json, torch
from torch import nn
from runner.models.gpt import GPT

class PlainHead(nn.Linear):  # the head as nn.Linear is, on the same weight
    def forward(self, x, embedded=True, tied_gradient=None):
        return super().forward(x)

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

torch.set_num_threads(1)
ids = torch.randint(0, 16384, (2, 8), generator=torch.Generator().manual_seed(0))
peaks = {}
for tied in (False, True, False, True):  # each twice: the second is measured warm
    torch.manual_seed(0)
    model = GPT(vocab_size=16384, max_length=8, n_embd=256, n_head=2, n_layer=1)
    if not tied:
        model.lm_head = PlainHead(256, 16384, bias=False)
        model.lm_head.weight = model.wte.weight
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the resident high-water mark starts again from here
    loss.backward()
    peaks[str(tied)] = status("VmHWM:") - before
print(json.dumps(peaks))
"""


class _PlainHead(nn.Linear):
    """The lm head as nn.Linear is, on the same weight."""

    def forward(self, x: torch.Tensor, embedded: bool = True, tied_gradient: object = None) -> torch.Tensor:
        return super().forward(x)


def test_the_tied_weights_gradient_is_made_in_one_whole_tensor_bit_for_bit() -> None:
    """Autograd would sum the head's gradient of the tied weight (a view) and the embedding's (a whole tensor of
    zeros around the batch's rows) into a third whole tensor: three at the backward pass's peak. The head hands
    its share, laid out as the weight, on to the embedding's backward, which adds its rows in place: one whole
    tensor, and the same gradient bit for bit."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, "-c", _TIED_PEAKS], env=env, capture_output=True, text=True, check=True)
    peaks = json.loads(done.stdout.splitlines()[-1])
    weight = 16384 * 256 * 4
    assert peaks["True"] <= 1.5 * weight < 2.5 * weight <= peaks["False"], peaks

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = {}
    for tied in (True, False):
        torch.manual_seed(0)
        model = GPT(vocab_size=64, max_length=8, n_embd=32, n_head=2, n_layer=1)
        if not tied:
            model.lm_head = _PlainHead(32, 64, bias=False)
            model.lm_head.weight = model.wte.weight
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        grads[tied] = {name: p.grad for name, p in model.named_parameters()}
    assert all(torch.equal(grads[True][name], grads[False][name]) for name in grads[False])


def test_gpt2_size_has_gpt2_small_parameter_count() -> None:
    with torch.device("meta"):  # no memory and no init time for 124M parameters
        model = GPT(vocab_size=50257, max_length=1024, size="gpt2")
    count = _count(model)
    print(f"gpt2 size: {count:,} parameters")
    assert count == 124_439_808
    assert len(model.blocks) == 12 and isinstance(model.blocks, nn.ModuleList)


@pytest.mark.parametrize("size, expected", [("tiny", (2, 2, 128)), ("mini", (4, 4, 256)), ("small", (6, 6, 384))])
def test_named_sizes_and_overrides(size: str, expected: tuple[int, int, int]) -> None:
    with torch.device("meta"):
        model = GPT(vocab_size=10, size=size)
        overridden = GPT(vocab_size=10, size=size, n_layer=1)
    assert (model.n_layer, model.n_head, model.n_embd) == expected
    assert (overridden.n_layer, overridden.n_head, overridden.n_embd) == (1, *expected[1:])
    assert len(overridden.blocks) == 1


def test_residual_projections_start_smaller() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=100, max_length=8, n_layer=8, n_embd=256, n_head=4)
    std = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(std - 0.02 / 4) < 0.001  # 0.02 / sqrt(2 * 8)
    assert abs(model.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.001


@pytest.fixture
def one_thread():
    # on a shared, loaded CPU two intra-op threads mostly wait on each other (measured ~15x slower)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_model_overfits_a_fixed_batch(one_thread: None) -> None:
    torch.manual_seed(0)
    vocab = 64
    model = GPT(vocab_size=vocab, max_length=32)
    tokens = torch.randint(0, vocab, (4, 33))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(200):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if losses[-1] < 0.1 * losses[0]:  # the property is reached: stop paying for CPU steps
            break
    print(f"gpt tiny overfit: loss {losses[0]:.3f} -> {losses[-1]:.4f} in {len(losses)} steps")
    assert losses[-1] < 0.1 * losses[0]


def test_sequence_longer_than_max_length_is_refused_in_one_line() -> None:
    model = GPT(vocab_size=10, max_length=8)
    with pytest.raises(ValueError, match=r"^input_ids: sequence length 9 exceeds max_length=8;[^\n]*$"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(n_embd=100, n_head=3), r"^n_embd: 100 is not divisible by n_head=3; allowed: [^\n]*$"),
    (dict(n_layer=0), r"^n_layer: 0 is too small; allowed: an integer >= 1$"),
    (dict(dropout=1.0), r"^dropout: 1.0 is out of range; allowed: 0 <= dropout < 1$"),
    (dict(size="huge"), r"^size: 'huge' is not a known size; allowed: tiny, mini, small, gpt2$"),
])
def test_bad_values_raise_one_line_naming_the_parameter(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        GPT(vocab_size=10, **kwargs)
