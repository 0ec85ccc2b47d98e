"""Pipeline parallelism where it meets the rest of the runner (issue 35's defects at the seams): dict batches,
pp x tp's build, BatchNorm and ragged batches, SWA's BatchNorm statistics (the batch-size finder under pp
is refused by the composition table: tests/runner/specs/test_composition.py). Each
case runs real gloo processes against one process, as tests/runner/engine/test_pipeline_parallel.py does
(its helpers and tolerance)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.runner.engine.test_pipeline_parallel import GPT, assert_like_one_process, run_two

# a user's token sequences whose batches are dicts ({"input_ids", "labels"}, labels partly -100): 90 to train
DICT_TOKENS = ["dataset._target_=tests.user_pkg.tokens.build", "task=language_modeling", "model=gpt", "model.n_embd=32",
               "model.n_head=2", "model.n_layer=2", "optimizer=sgd", "trainer.max_steps=4", "trainer.progress_bar=off",
               "trainer.eval_every_n_steps=2", "trainer.log_every_n_steps=1", "dataset.batch_size=8"]


def test_dict_batches_run_through_the_pipeline_like_one_process(tmp_path: Path, two_ranks) -> None:
    """A dataset whose batches are dicts (the language-model corpus's layout): the first stage takes the batch's
    keys, the later stage only the activations (torch hands a micro-batch's kwargs to every stage; gpt's second
    stage got `input_ids` twice). 4 micro-batches of 2 rows, 1F1B."""
    assert_like_one_process(tmp_path, DICT_TOKENS, ["parallelism.pp_schedule=1f1b", "parallelism.pp_microbatches=4"],
                            two_ranks=two_ranks)


def test_pp2_times_tp2_builds_and_trains_like_one_process(tmp_path: Path) -> None:
    """pp=2 x tp=2 (4 processes, 2 steps: the engine's build crashed on every rank, plan_source's tp missing); the
    exactness over a whole epoch with accumulation is test_pipeline_parallel.py's slow case."""
    common = [*GPT, "dataset.batch_size=8", "trainer.max_steps=2",
              "trainer.eval_every_n_steps=2"]
    assert_like_one_process(tmp_path, common, ["parallelism.tp=2", "parallelism.pp_microbatches=2"], world=4)


# 100 samples: 70 to train at batch 8 (a ragged last batch of 6), 15 to validate, 15 to test
BATCHNORM = ["dataset=synthetic", "dataset.shape=[1,4,4]", "dataset.size=100", "dataset.num_classes=3",
             "dataset.batch_size=8", "model._target_=tests.user_pkg.batchnorm.bn_mlp", "optimizer=sgd",
             "trainer.max_epochs=1", "trainer.progress_bar=off", "trainer.eval_every_n_steps=3",
             "trainer.log_every_n_steps=1"]
STAGES = ["parallelism.pp_plan={_target_:tests.user_pkg.stages.mlp_stage}", "parallelism.pp_schedule=gpipe",
          "parallelism.pp_microbatches=1"]


def test_a_batchnorm_model_counts_no_padded_row_under_the_pipeline(tmp_path: Path, two_ranks) -> None:
    """BatchNorm under pp with one micro-batch: the ragged last batch (6 of 8 rows) runs as a micro-batch of its
    own 6 rows, not padded with copies of its last row, so the running statistics, num_batches_tracked and the
    weights are one process's (the padded rows put them 1-6% off)."""
    assert_like_one_process(tmp_path, BATCHNORM, STAGES, two_ranks=two_ranks)


def test_a_batchnorm_model_with_several_micro_batches_is_refused_in_one_line(tmp_path: Path, two_ranks) -> None:
    """Each micro-batch would be normalised by its own statistics (and counted in num_batches_tracked): refused
    alike on every stage, also on a rank whose stages hold no BatchNorm."""
    out = run_two([*BATCHNORM, *STAGES[:2], "parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.pp=2",
                   "parallelism.pp_microbatches=2"], tmp_path / "run", two_ranks=two_ranks)
    # the model's composition check, which every rank's engine runs on the whole model before it cuts its stages
    assert out["error"].startswith("model: tests.user_pkg.batchnorm.bn_mlp's BatchNorm layer '2' with "
                                   "parallelism.pp_microbatches=2: each micro-batch would"), out["error"]
    assert out["error"].endswith("use parallelism.pp_microbatches=1 with pp_schedule=gpipe, or a norm that does not "
                                 "mix samples (LayerNorm, GroupNorm)"), out["error"]
    assert "\n" not in out["error"]


def test_swa_recomputes_batchnorm_statistics_through_the_pipeline_like_one_process(tmp_path: Path, two_ranks) -> None:
    """SWA's update_bn at the end of training runs the training split through every stage (this rank's part of
    the model alone cannot take a batch: it raised a TypeError and left no final checkpoint); the averaged
    weights' statistics, the test metrics and the final weights are one process's."""
    from runner.engine import checkpoint
    from tests.runner.engine.test_parallel import assert_same

    common = [*BATCHNORM, "trainer.max_epochs=2", "trainer.swa.start_epoch=0"]
    assert_like_one_process(tmp_path, common, STAGES, two_ranks=two_ranks)
    saved = [checkpoint.load(tmp_path / d / "checkpoints" / "last.pt")["addons"]["averages"]["swa"]["values"]
             for d in ("one", "two")]
    assert any(k.endswith("running_mean") for k in saved[0])
    assert_same(saved[1], saved[0])
