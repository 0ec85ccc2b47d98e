"""The debug presets (conf/debug/, runner/engine/debugging.py), each on the default run (digits, mlp) and on a tiny gpt."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from runner.engine.engine import Engine
from runner.engine.run_data import build_data
from runner.engine import monitor
from runner.engine.monitor import Diverged
from tests.conftest import compose_spec

DIGITS = ["model.hidden=[32]"]
GPT = ["dataset=synthetic_tokens", "model=gpt", "task=language_modeling", "dataset.vocab_size=32",
       "dataset.block_size=8", "dataset.size=200", "dataset.batch_size=4", "model.n_layer=1", "model.n_head=2",
       "model.n_embd=16"]
RUNS = pytest.mark.parametrize("run", [DIGITS, GPT], ids=["digits", "gpt"])


@pytest.fixture(autouse=True)
def no_curves_plot(monkeypatch) -> None:
    """The end-of-run plot is a second of matplotlib per run and none of these tests' business."""
    monkeypatch.setattr(monitor, "plot_curves", lambda *args, **kwargs: None)


def engine(overrides: list[str], run_dir: Path) -> Engine:
    return Engine(compose_spec(["trainer.memory_estimate=false", *overrides], run_dir))


def said(caplog, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


@RUNS
def test_fast_runs_two_steps_evaluates_two_batches_and_writes_no_checkpoint(tmp_path: Path, run: list[str]) -> None:
    e = engine(["debug=fast", *run], tmp_path / "run")
    assert e.spec.tracking.name == "none" and e.spec.trainer.progress_bar == "off"
    result = e.fit()
    batch = e.spec.dataset.batch_size
    assert result.steps == 2 and e.progress.step == 2
    assert e.split_sizes["val"] == e.split_sizes["test"] == 2 * batch  # max_eval_batches: 2
    assert result.final and all(k.startswith("test/") for k in result.final)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_overfit_reaches_a_near_zero_loss_on_a_few_digits_batches_and_says_so(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        e = engine(["debug=overfit", *DIGITS, "trainer.overfit_batches=2", "dataset.batch_size=8",
                    "optimizer.lr=0.03"], tmp_path / "run")
        result = e.fit()
    assert e.split_sizes["train"] == 16
    lines = said(caplog, "overfit:")
    assert len(lines) == 1 and lines[0].startswith("overfit: reached, training loss "), lines
    assert lines[0].endswith(f"< 0.01 at step {result.steps}") and result.steps < 1000
    # the 16 samples it trained on, read back: their mean loss is near zero too
    x, y = e.train_loader.dataset.tensors
    e.model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(e.model(x), y).item()
    assert loss < 0.01, loss


def test_overfit_says_it_was_not_reached_when_max_steps_is_too_short(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        result = engine(["debug=overfit", *DIGITS, "trainer.max_steps=3"], tmp_path / "run").fit()
    lines = said(caplog, "overfit:")
    assert result.steps == 3 and len(lines) == 1, lines
    assert lines[0].startswith("overfit: not reached, training loss ") and lines[0].endswith(
        " after 3 steps (target 0.01); raise trainer.max_steps or optimizer.lr"), lines


@pytest.mark.slow  # ~25 s on a loaded CPU; test_overfit_reaches_a_near_zero_loss_on_a_few_digits_batches_and_says_so keeps the goal in CI
def test_overfit_on_gpt_memorises_one_batch(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        result = engine(["debug=overfit", *GPT, "trainer.overfit_batches=1", "optimizer.lr=0.01"], tmp_path / "run").fit()
    lines = said(caplog, "overfit:")
    assert lines == [lines[0]] and lines[0].startswith("overfit: reached") and result.steps < 1000, lines


@pytest.mark.parametrize("run, sizes", [(DIGITS, {"train": 125, "val": 27, "test": 27}),  # of 1257, 270, 270
                                       (GPT, {"train": 18, "val": 1, "test": 1})],  # of 180, 10, 10
                         ids=["digits", "gpt"])
def test_limit_uses_the_first_tenth_of_each_split(tmp_path: Path, run: list[str], sizes: dict) -> None:
    e = engine(["debug=limit", *run], tmp_path / "run")
    full = build_data(e.spec)
    assert {split: len(getattr(full, split)) // 10 or 1 for split in sizes} == sizes
    assert e.split_sizes == sizes and e.train_loader.batch_sampler.size == sizes["train"]
    for split, loader in (("train", e.train_loader), *e.eval_loaders.items()):  # each split's first samples
        limited = loader.dataset
        for i in (0, sizes[split] - 1):
            assert all(torch.equal(a, b) for a, b in zip(limited[i], getattr(full, split)[i]))


def test_limit_takes_the_same_samples_on_every_rank_before_sharding(tmp_path: Path) -> None:
    """Two ranks of the limited split together see exactly its first samples, each once."""
    from runner.engine.debugging import head
    from runner.engine.loader import EpochBatches

    data = list(range(100))
    limited = head(data, 10)
    ranks = [EpochBatches(len(limited), 3, seed=0, shuffle=True, dp_rank=r, dp_degree=2) for r in range(2)]
    seen = sorted(i for r in ranks for batch in r for i in batch)
    assert seen == list(range(10)) and [limited[i] for i in seen] == data[:10]


def test_anomaly_stops_at_the_step_that_made_nan_in_one_line(tmp_path: Path) -> None:
    e = engine(["debug=anomaly", "model._target_=tests.user_pkg.nan_net.NanFrom", "trainer.max_steps=6"], tmp_path / "run")
    e.module.calls = 0  # building the engine ran a forward of its own: count the training steps only
    with pytest.raises(Diverged) as error:
        e.fit()
    text = str(error.value)
    assert "\n" not in text and e.progress.step == 2  # the 3rd step raised inside its backward
    assert text == ("step 3: autograd anomaly detection: Function 'LogSoftmaxBackward0' returned nan values in its 0th "
                    "output. (the forward call that made it is in the warning above)")


def test_anomalys_finite_check_runs_every_step(tmp_path: Path) -> None:
    """Without anomaly detection, the per-step check stops the run at the first NaN step, not at the next log step."""
    e = engine(["debug=anomaly", "trainer.detect_anomaly=false", "model._target_=tests.user_pkg.nan_net.NanFrom",
                "trainer.max_steps=6"], tmp_path / "run")
    e.module.calls = 0
    with pytest.raises(Diverged, match=r"^the loss is not finite from step 3 on \(1 step\(s\) in a row\)"):
        e.fit()
    assert e.progress.step == 3


GPT_SLOW = pytest.param(GPT, id="gpt", marks=pytest.mark.slow)  # CI budget: the digits case keeps the preset in CI


# slow (CI budget): test_anomaly_stops_at_the_step_that_made_nan_in_one_line runs the preset in CI
@pytest.mark.slow
@RUNS
def test_anomaly_preset_completes_a_healthy_run(tmp_path: Path, run: list[str]) -> None:
    e = engine(["debug=anomaly", *run, "trainer.max_steps=2", "trainer.eval_every_epoch=false"], tmp_path / "run")
    assert e.fit().steps == 2 and torch.is_anomaly_enabled() is False  # switched off again after the run


@pytest.mark.parametrize("run", [DIGITS, GPT_SLOW], ids=["digits", "gpt"])
def test_profile_preset_profiles_a_short_run(tmp_path: Path, run: list[str]) -> None:
    e = engine(["debug=profile", *run, "trainer.profile_skip_steps=1", "trainer.profile_steps=2", "trainer.max_steps=3"],
               tmp_path / "run")
    assert e.fit().steps == 3 and e.profiler.figures.steps == 2
    assert (tmp_path / "run" / "profile" / "profile_rank0.pt.trace.json").exists()


# slow (CI budget): test_limit_takes_the_same_samples_on_every_rank_before_sharding and
# test_limit_uses_the_first_tenth_of_each_split keep the limit's subset in CI
@pytest.mark.slow
def test_a_limited_run_resumed_mid_epoch_ends_as_if_never_stopped(tmp_path: Path) -> None:
    from tests.runner.engine.test_engine import assert_same_weights, ctrl_c_during_step

    common = ["debug=limit", *DIGITS, "dataset.batch_size=16", "trainer.max_steps=12", "trainer.checkpoint_every_n_steps=1",
              "trainer.eval_every_epoch=false", "trainer.progress_bar=off"]  # 125 samples: 8 steps an epoch
    straight = engine(common, tmp_path / "a")
    straight.fit()
    with pytest.raises(KeyboardInterrupt):
        ctrl_c_during_step(engine(common, tmp_path / "b"), 10).fit()  # epoch 1, mid-way
    resumed = engine([*common, f"trainer.resume={tmp_path / 'b'}"], tmp_path / "b")
    assert resumed.progress.step == 9 and resumed.split_sizes["train"] == 125
    resumed.fit()
    assert resumed.progress.step == 12
    assert_same_weights(straight, resumed, rtol=1e-6)


@pytest.mark.slow
def test_two_ranks_of_a_limited_run_train_like_one_process(tmp_path: Path) -> None:
    """The limit is taken before the samples are dealt to ranks: 2 ranks at batch 8 equal one process at 16."""
    from tests.conftest import run_cli
    from tests.runner.engine.test_parallel import assert_same, final_weights

    common = ["debug=limit", "trainer.limit_train=0.2", *DIGITS, "trainer.max_epochs=2", "trainer.progress_bar=off",
              "tracking=none", "trainer.memory_estimate=false"]  # 251 samples: a ragged last batch
    single = engine([*common, "dataset.batch_size=16"], tmp_path / "one")
    single.fit()
    proc = run_cli([*common, "parallelism=ddp", "parallelism.nproc_per_node=2", "dataset.batch_size=8",
                    f"hydra.run.dir={tmp_path / 'two'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same(final_weights(tmp_path / "two"), final_weights(tmp_path / "one"))


def test_overfit_resumed_one_step_before_the_goal_reaches_it_at_the_same_step(tmp_path: Path) -> None:
    """The last pass's losses are checkpointed: a resume does not start the pass over (it would end later)."""
    goal = ["debug=overfit", *DIGITS, "trainer.overfit_batches=2", "dataset.batch_size=8", "optimizer.lr=0.03",
            "trainer.save_checkpoints=true"]
    reached = engine(goal, tmp_path / "whole").fit().steps
    assert 2 < reached < 1000
    engine([*goal, f"trainer.max_steps={reached - 1}"], tmp_path / "cut").fit()
    resumed = engine([*goal, f"trainer.resume={tmp_path / 'cut'}"], tmp_path / "cut")
    assert resumed.progress.step == reached - 1 and resumed.fit().steps == reached


def test_an_optimizer_without_state_resumes_as_if_never_stopped(tmp_path: Path) -> None:
    """SGD without momentum keeps no per-parameter state: torch's full-state loader refused its checkpoint."""
    sgd = [*DIGITS, "optimizer=sgd", "optimizer.momentum=0", "trainer.eval_every_epoch=false", "trainer.progress_bar=off",
           "trainer.log_every_n_steps=1"]
    whole = engine([*sgd, "trainer.max_steps=4"], tmp_path / "whole")
    whole.fit()
    engine([*sgd, "trainer.max_steps=2"], tmp_path / "cut").fit()
    resumed = engine([*sgd, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'cut'}"], tmp_path / "cut")
    assert resumed.progress.step == 2
    resumed.fit()
    for key, value in whole.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[key]), key
    assert resumed.monitor.history["train/loss"] == whole.monitor.history["train/loss"]
