"""Pipeline parallelism where it meets the rest of the runner (issue 35's defects at the seams): dict batches,
pp x tp's build, BatchNorm and ragged batches, SWA's BatchNorm statistics and the batch-size finder. Each
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
