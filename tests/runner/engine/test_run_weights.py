"""runner/engine/run_weights.py: which weights of a trained run are meant, and its one-line refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.engine import run_weights
from runner.engine.engine import Engine
from runner.specs.run import SpecError
from tests.conftest import compose_spec


def test_a_tied_parameter_the_average_keeps_once_takes_its_twins_average_under_both_names() -> None:
    """An average holds gpt's tied wte/lm_head weight once; a checkpoint saved from a GPU holds the tie as two
    copies (no shared storage): both names must take the average, or a load would put the raw one back."""
    tied, other = torch.randn(4, 3), torch.randn(3)
    model = {"wte.weight": tied, "bias": other, "lm_head.weight": tied.clone()}
    ema = {"wte.weight": torch.randn(4, 3), "bias": torch.randn(3)}
    weights = run_weights.RunWeights(Path("run"), "last", 5, "ema",
                                     {"model": model, "averages": {"ema": {"count": 5, "values": ema}}})
    got = weights.state_dict()
    assert torch.equal(got["wte.weight"], ema["wte.weight"]) and torch.equal(got["lm_head.weight"], ema["wte.weight"])
    assert torch.equal(got["bias"], ema["bias"]) and weights.source == "last@step 5 (ema)"
    raw = run_weights.RunWeights(Path("run"), "best", 2, "none", {"model": model}).state_dict()
    assert all(torch.equal(raw[k], v) for k, v in model.items())


def test_weights_a_run_does_not_keep_are_refused_in_one_line(tmp_path: Path) -> None:
    # lr 0.3 overshoots: the best validation (step 2) is not the last (step 4); test_on=last keeps no best file
    Engine(compose_spec(["model.hidden=[16]", "dataset.batch_size=256", "optimizer.lr=0.3", "trainer.max_steps=4",
                         "trainer.eval_every_n_steps=2", "trainer.eval_every_epoch=false", "trainer.test_on=last",
                         "trainer.progress_bar=off", "trainer.memory_estimate=false"], tmp_path / "run")).fit()
    run_dir = tmp_path / "run"
    assert run_weights.read(run_dir).source == "last@step 4"  # what it tested
    with pytest.raises(SpecError, match=r"^weights.which: best: .* keeps no weights of its best step 2 "
                                        r"\(trainer.test_on=last or trainer.save_checkpoints=false\); use weights.which=last$"):
        run_weights.read(run_dir, which="best")
    with pytest.raises(SpecError, match=r"^weights.average: ema: .*step-00000004.pt holds no EMA weights \(the run "
                                        r"trained without trainer.ema\); choose weights.average=none$"):
        run_weights.read(run_dir, average="ema")
    with pytest.raises(SpecError, match="^weights.which: 'worst'; choose one of tested, best, last$"):
        run_weights.read(run_dir, which="worst")
