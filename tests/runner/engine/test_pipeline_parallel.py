"""Pipeline parallelism (runner/engine/parallel/pipeline.py) with real processes on gloo: pp=2 equals one
process on the same global batch (weights, train/loss, val/loss and test metrics read back from MLflow),
for each schedule family, with ragged micro-batches; checkpoints reshard both ways; bad input in one line.

Tolerance: rtol 1e-5 (as test_parallel.py's). The pipeline sums each micro-batch's loss and the stages'
gradients in another order than one process summing the whole batch (fp32 reduction order), and the
tied embedding's gradient arrives as the sum of two stages' parts; nothing else differs. SGD (with
momentum) rather than Adam: a gradient that is 0 in exact arithmetic (the key projection's bias, which
softmax ignores) is rounding noise in both runs, and Adam's normalisation blows that noise up to lr-sized
steps.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from runner.engine import checkpoint
from runner.engine.engine import Engine
from runner.engine.parallel import DistEnv
from runner.specs.run import SpecError
from tests.conftest import compose_spec
from tests.runner.engine.test_parallel import assert_same, metric_history

# 90 blocks of 16 tokens: 82 to train (a ragged last step of 2 samples at batch 8 x accum 2), 4 to validate, 4 to test
GPT = ["dataset=synthetic_tokens", "dataset.vocab_size=64", "dataset.block_size=16", "dataset.size=90",
       "model=gpt", "model.n_embd=32", "model.n_head=2", "task=language_modeling", "optimizer=sgd",
       "trainer.max_epochs=1", "trainer.progress_bar=off", "trainer.eval_every_n_steps=3", "trainer.log_every_n_steps=1"]
VIT = ["dataset=synthetic", "dataset.shape=[3,8,8]", "dataset.size=100", "dataset.val_fraction=0.1",
       "dataset.test_fraction=0.1", "model=vit", "model.patch_size=4", "model.dim=16", "model.depth=2", "model.heads=2",
       "optimizer=sgd", "trainer.max_epochs=1", "trainer.progress_bar=off", "trainer.eval_every_n_steps=3",
       "trainer.log_every_n_steps=1"]
PP2 = ["parallelism=ddp", "parallelism.nproc_per_node=2", "parallelism.pp=2"]
COMPARED = ("train/loss", "val/loss", "test/loss", "lr")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, overrides: list[str], run_dir: str, db: str | None,
            out: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo")
    try:
        report = _fit(rank, world, overrides, run_dir, db)
        if rank == 0:
            out.put(report)
    finally:
        torch.distributed.destroy_process_group()


def _fit(rank: int, world: int, overrides: list[str], run_dir: str, db: str | None) -> dict | None:
    """Rank 0's report (plain values: a tensor in a queue would outlive the process sharing its memory)."""
    from runner.tracking.tracker import build_tracker

    try:
        spec = compose_spec(overrides, Path(run_dir), tracking_uri=f"sqlite:///{db}" if db else None)
        tracker = build_tracker(spec) if rank == 0 and db else None
        engine = Engine(spec, tracker, DistEnv(rank, world, rank))
        result = engine.fit()
        # each stage's own copy of a parameter the whole model shares (gpt: wte.weight = lm_head.weight)
        # (whole: a tensor-parallel part is gathered over its tp group)
        tied = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in engine.module.named_parameters(remove_duplicate=False) if n in ("wte.weight", "lm_head.weight")}
        every = [None] * world
        torch.distributed.all_gather_object(every, tied)
        if rank == 0:
            copies = [t for part in every for t in part.values()]
            diff = max((float((t - copies[0]).abs().max()) for t in copies), default=float("nan"))
            return {"final": result.final, "tied": [sorted(part) for part in every], "tied_diff": diff,
                    "bubble": result.pp_bubble}
    except SpecError as e:
        if rank == 0:
            return {"error": str(e)}
    return None


def run_two(overrides: list[str], run_dir: Path, db: Path | None = None, world: int = 2, two_ranks=None) -> dict:
    """Rank 0's report of a run of `world` gloo processes: the session's two ranks where given
    (tests/conftest.py), else new ones."""
    if world == 2 and two_ranks is not None:
        return two_ranks.run(_fit, overrides, str(run_dir), str(db) if db else None)[0]
    out = mp.get_context("spawn").Queue()
    mp.spawn(_worker, args=(world, _free_port(), overrides, str(run_dir), str(db) if db else None, out), nprocs=world)
    return out.get(timeout=10)


def run_one(overrides: list[str], run_dir: Path, db: Path | None = None):
    from runner.tracking.tracker import build_tracker

    spec = compose_spec(overrides, run_dir, tracking_uri=f"sqlite:///{db}" if db else None)
    return Engine(spec, build_tracker(spec) if db else None).fit()


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def assert_like_one_process(tmp_path: Path, common: list[str], pp: list[str], one: list[str] = (),
                            world: int = 2, two_ranks=None) -> dict:
    run_one([*common, *one], tmp_path / "one", tmp_path / "one.db")
    launch = PP2 if world == 2 else ["parallelism=ddp", f"parallelism.nproc_per_node={world}", "parallelism.pp=2"]
    two = run_two([*common, *launch, *pp], tmp_path / "two", tmp_path / "two.db", world, two_ranks)
    assert_same(weights(tmp_path / "two"), weights(tmp_path / "one"))
    one_log, two_log = metric_history(tmp_path / "one.db"), metric_history(tmp_path / "two.db")
    for key in COMPARED:
        assert [s for s, _ in two_log[key]] == [s for s, _ in one_log[key]], key
        for (_, a), (_, b) in zip(one_log[key], two_log[key]):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7), key
    return two


def test_pp2_1f1b_trains_gpt_like_one_process_with_accumulation_ragged_batches_and_micro_batches(tmp_path: Path,
                                                                                                 two_ranks) -> None:
    """1F1B, 3 micro-batches of a per-rank batch of 8 (3+3+2 rows), accumulation 2, a ragged last step
    (2 samples): the logged train/loss, val/loss, test metrics and the final weights are one process's; the
    tied embedding and lm head, held by the first and last stage, stay equal."""
    common = [*GPT, "dataset.batch_size=8", "+accum=2"]
    two = assert_like_one_process(tmp_path, common, ["parallelism.pp_schedule=1f1b", "parallelism.pp_microbatches=3"],
                                  two_ranks=two_ranks)
    assert two["tied"] == [["wte.weight"], ["lm_head.weight"]]  # each stage holds its own copy
    assert two["tied_diff"] == 0.0
    assert 0.0 < two["bubble"] < 1.0  # the first stage's share of its schedule time not computing (a benchmark's figure)


@pytest.mark.slow  # 2 processes each; 1f1b stays in CI
@pytest.mark.parametrize("schedule, layers", [("gpipe", 2), ("interleaved_1f1b", 4), ("looped_bfs", 4),
                                              ("interleaved_zero_bubble", 4), ("zbv_zero_bubble", 4)])
def test_every_schedule_trains_gpt_like_one_process(tmp_path: Path, schedule: str, layers: int) -> None:
    common = [*GPT, f"model.n_layer={layers}", "dataset.batch_size=8", "+accum=2"]
    two = assert_like_one_process(tmp_path, common, [f"parallelism.pp_schedule={schedule}"])
    assert sum(map(len, two["tied"])) >= 2 and two["tied_diff"] == 0.0


def test_pp2_gpipe_trains_vit_like_one_process(tmp_path: Path, two_ranks) -> None:
    """In CI: vit's stages are shallow copies holding its class token and positions in their own dict (gpt's stages
    hold no parameter of their own); built on the meta device, the first stage trained on uninitialised memory
    and its checkpoint met meta tensors."""
    assert_like_one_process(tmp_path, [*VIT, "dataset.batch_size=8", "+accum=2"],
                            ["parallelism.pp_schedule=gpipe", "parallelism.pp_microbatches=3"], two_ranks=two_ranks)


@pytest.mark.slow  # 4 processes
def test_pp2_times_ddp2_trains_like_one_process_on_the_global_batch(tmp_path: Path) -> None:
    """pp=2 x dp_replicate=2 at a per-rank batch of 4 equals one process at 8 (accumulation 2, a ragged last step)."""
    assert_like_one_process(tmp_path, [*GPT, "+accum=2"], ["dataset.batch_size=4"], one=["dataset.batch_size=8"],
                            world=4)


@pytest.mark.slow  # 4 processes
@pytest.mark.parametrize("split", [[], ["parallelism.sequence_parallel=false", "parallelism.loss_parallel=false"]],
                         ids=["sp_lp", "plain"])
def test_pp2_times_tp2_trains_gpt_like_one_process(tmp_path: Path, split: list[str]) -> None:
    """pp=2 x tp=2: each stage split over its two tp ranks (the tensor plan reaches the stages' parameters),
    the stages exchanging whole plain activations (a sequence-parallel stream gathered before the send and split
    again after), the last stage's loss on vocabulary-sharded logits (loss_parallel); 1F1B with 3 micro-batches,
    accumulation 2 and a ragged last step equal one process (tolerance: the module's, 1e-5; tp adds the two halves
    of each matmul's inner sum by an all-reduce, another fp32 order). The tied embedding's two copies (first and
    last stage) stay equal, each tp rank's part of them alike."""
    common = [*GPT, "dataset.batch_size=8", "+accum=2"]
    two = assert_like_one_process(tmp_path, common, ["parallelism.tp=2", "parallelism.pp_schedule=1f1b",
                                                     "parallelism.pp_microbatches=3", *split], world=4)
    assert two["tied_diff"] == 0.0


@pytest.mark.slow  # 4 processes
def test_pp2_times_fsdp2_trains_like_one_process_on_the_global_batch(tmp_path: Path) -> None:
    """pp=2 x dp_shard=2: each stage fully_shard-ed over its two replicas (torch's PipelineStage holds FSDP's
    reduce-scatter to the schedule's last micro-batch, which averages over dp_shard once); a per-rank batch of 4
    equals one process at 8 (accumulation 2, a ragged last step, tolerance 1e-5: FSDP's reduce-scatter is one more
    fp32 sum in another order)."""
    fsdp = ["parallelism.dp_replicate=1", "parallelism.dp_shard=-1", "dataset.batch_size=4"]
    assert_like_one_process(tmp_path, [*GPT, "+accum=2"], fsdp, one=["dataset.batch_size=8"], world=4)


@pytest.mark.slow
def test_ema_and_swa_of_the_stages_evaluate_and_resume_like_one_process(tmp_path: Path) -> None:
    """trainer.ema and trainer.swa under pp=2: each rank averages its own stages' weights, the averages are
    evaluated through the pipeline (val/ema/loss, val/swa/loss equal one process's) and a checkpoint holds the
    whole model's averages, which a pp=2 run resumed from one process's checkpoint continues."""
    common = [*GPT, "dataset.batch_size=8", "trainer.max_epochs=2", "trainer.ema.decay=0.9",
              "trainer.swa.start_epoch=0", "trainer.checkpoint_every_n_steps=6", "trainer.keep_checkpoints=5"]
    run_one(common, tmp_path / "one", tmp_path / "one.db")
    run_two([*common, *PP2], tmp_path / "two", tmp_path / "two.db")
    assert_same(weights(tmp_path / "two"), weights(tmp_path / "one"))
    one_log, two_log = metric_history(tmp_path / "one.db"), metric_history(tmp_path / "two.db")
    for key in ("val/ema/loss", "val/swa/loss", "train/loss", "val/loss"):
        assert [s for s, _ in two_log[key]] == [s for s, _ in one_log[key]] and one_log[key], key
        for (_, a), (_, b) in zip(one_log[key], two_log[key]):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7), key
    saved = {d: checkpoint.load(tmp_path / d / "checkpoints" / "last.pt")["addons"]["averages"] for d in ("one", "two")}
    for kind in ("ema", "swa"):
        assert_same(saved["two"][kind]["values"], saved["one"][kind]["values"])
    run_two([*common, *PP2, f"trainer.resume={tmp_path / 'one' / 'checkpoints' / 'step-00000006.pt'}"],
            tmp_path / "from_one")
    resumed = checkpoint.load(tmp_path / "from_one" / "checkpoints" / "last.pt")["addons"]["averages"]
    for kind in ("ema", "swa"):
        assert_same(resumed[kind]["values"], saved["one"][kind]["values"])


@pytest.mark.slow
def test_pp2_under_bf16_autocast_trains_like_one_process(tmp_path: Path) -> None:
    """precision=bf16 (autocast): the stages exchange bf16 activations. Tolerance 1e-2: bf16 keeps 8 bits of
    mantissa (relative rounding 4e-3), and the micro-batches' matmuls may round differently from the whole batch's."""
    common = [*GPT, "dataset.batch_size=8", "precision=bf16", "trainer.max_steps=6"]
    run_one(common, tmp_path / "one", tmp_path / "one.db")
    run_two([*common, *PP2], tmp_path / "two", tmp_path / "two.db")
    assert_same(weights(tmp_path / "two"), weights(tmp_path / "one"), rtol=1e-2)
    one_log, two_log = metric_history(tmp_path / "one.db"), metric_history(tmp_path / "two.db")
    for key in ("train/loss", "val/loss"):
        for (_, a), (_, b) in zip(one_log[key], two_log[key], strict=True):
            assert b == pytest.approx(a, rel=1e-2), key


@pytest.mark.slow
def test_early_stopping_and_the_test_on_best_weights_run_through_the_pipeline_like_one_process(tmp_path: Path) -> None:
    """Early stopping decides alike on both stages (the metric sums reach every rank) and stops where one
    process stops; the best weights' test loads them into each stage."""
    import sqlite3

    common = [*GPT, "dataset.batch_size=8", "optimizer.lr=3.0", "trainer.eval_every_n_steps=2", "trainer.test_on=best",
              "trainer.early_stopping.monitor=val/loss", "trainer.early_stopping.patience=1",
              "trainer.early_stopping.min_delta=10"]
    assert_like_one_process(tmp_path, common, [])
    tags = []
    for db in ("one.db", "two.db"):
        with sqlite3.connect(tmp_path / db) as con:
            tags.append(dict(con.execute("select key, value from tags where key = 'test_from'")))
    assert tags[0] == tags[1] and tags[0]["test_from"].startswith("best@step")
    assert max(s for s, _ in metric_history(tmp_path / "two.db")["train/loss"]) == 4  # stopped at the 2nd evaluation


@pytest.mark.slow  # CI budget: pp=2 equal to one process stays in CI with gpt's own plan (1f1b)
def test_a_users_pp_plan_by_target_trains_like_one_process(tmp_path: Path) -> None:
    """parallelism.pp_plan={_target_: tests.user_pkg.stages.mlp_stage}: the mlp, which has no plan of its own."""
    common = ["dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.size=100", "model=mlp", "model.hidden=[16,16]",
              "optimizer=sgd", "trainer.max_steps=4", "trainer.progress_bar=off", "trainer.eval_every_n_steps=2",
              "dataset.batch_size=8", "trainer.log_every_n_steps=1"]
    assert_like_one_process(tmp_path, common, ["parallelism.pp_plan={_target_:tests.user_pkg.stages.mlp_stage}"])


@pytest.mark.slow
def test_checkpoints_reshard_between_pp2_and_one_process(tmp_path: Path) -> None:
    """A pp=2 checkpoint of step 3 resumed in one process, and one process's resumed at pp=2, end as the
    uninterrupted runs do."""
    common = [*GPT, "dataset.batch_size=8", "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3",
              "trainer.keep_checkpoints=5"]
    run_one(common, tmp_path / "one")
    run_two([*common, *PP2], tmp_path / "two")
    assert_same(weights(tmp_path / "two"), weights(tmp_path / "one"))
    run_one([*common, f"trainer.resume={tmp_path / 'two' / 'checkpoints' / 'step-00000003.pt'}"], tmp_path / "from_two")
    assert_same(weights(tmp_path / "from_two"), weights(tmp_path / "one"))
    run_two([*common, *PP2, f"trainer.resume={tmp_path / 'one' / 'checkpoints' / 'step-00000003.pt'}"],
            tmp_path / "from_one")
    assert_same(weights(tmp_path / "from_one"), weights(tmp_path / "one"))
    # the whole optimizer state: a pp checkpoint is one process's layout
    one, two = (checkpoint.load(tmp_path / d / "checkpoints" / "last.pt")["optimizer"] for d in ("one", "two"))
    assert set(one["state"]) == set(two["state"])
    assert [sorted(g["params"]) for g in one["param_groups"]] == [sorted(g["params"]) for g in two["param_groups"]]


@pytest.mark.slow  # 4 processes
@pytest.mark.parametrize("other", [["parallelism.tp=2"], ["parallelism.dp_replicate=1", "parallelism.dp_shard=-1"]],
                         ids=["tp2", "fsdp2"])
def test_checkpoints_reshard_between_pp2_times_tp2_or_fsdp2_and_one_process(tmp_path: Path, other: list[str]) -> None:
    """A pp=2 x tp=2 (or x dp_shard=2) checkpoint of step 3 (DTensor parts gathered whole) resumed in one process,
    and one process's resumed at that mesh, end as the uninterrupted run does (fsdp: a per-rank batch of 4)."""
    common = [*GPT, "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3", "trainer.keep_checkpoints=5"]
    batch = 4 if "parallelism.dp_shard=-1" in other else 8
    at_mesh = ["parallelism=ddp", "parallelism.nproc_per_node=4", "parallelism.pp=2", *other, f"dataset.batch_size={batch}"]
    one_batch = ["dataset.batch_size=8"]
    run_one([*common, *one_batch], tmp_path / "one")
    run_two([*common, *at_mesh], tmp_path / "two", world=4)
    assert_same(weights(tmp_path / "two"), weights(tmp_path / "one"))
    run_one([*common, *one_batch, f"trainer.resume={tmp_path / 'two' / 'checkpoints' / 'step-00000003.pt'}"],
            tmp_path / "from_two")
    assert_same(weights(tmp_path / "from_two"), weights(tmp_path / "one"))
    run_two([*common, *at_mesh, f"trainer.resume={tmp_path / 'one' / 'checkpoints' / 'step-00000003.pt'}"],
            tmp_path / "from_one", world=4)
    assert_same(weights(tmp_path / "from_one"), weights(tmp_path / "one"))


def test_a_model_without_a_pipeline_plan_is_refused_naming_pp_plan() -> None:
    from runner.engine.parallel.pipeline import cut_stage

    with pytest.raises(SpecError) as e:
        cut_stage(torch.nn.Sequential(torch.nn.Linear(2, 2)), None, "my_pkg.Net", 0, 2)
    assert str(e.value).startswith("parallelism.pp: my_pkg.Net has no pipeline plan (no pipeline_stage method); set "
                                   "parallelism.pp_plan={_target_: my_pkg.stage}")


@pytest.mark.slow  # in CI: its unit above
def test_a_model_without_a_pipeline_plan_is_refused_in_one_line(tmp_path: Path) -> None:
    out = run_two(["model=mlp", *PP2, "trainer.max_steps=1"], tmp_path / "run")
    assert out["error"].startswith("parallelism.pp: runner.models.mlp.MLP has no pipeline plan")
    assert "parallelism.pp_plan" in out["error"] and "\n" not in out["error"]


# the pipeline's keys and what it does not compose with: the spec's checks (tests/runner/specs/test_composition.py)


def test_more_stages_than_blocks_are_refused_in_one_line() -> None:
    from runner.engine.parallel.pipeline import cut_stage
    from runner.models.gpt import GPT
    from runner.models.vit import ViT

    for model in (GPT(vocab_size=16, n_layer=2, n_embd=8, n_head=2), ViT(num_classes=2, dim=8, depth=2, heads=2)):
        with pytest.raises(SpecError) as e:
            cut_stage(model, None, "m", 0, 4)
        assert str(e.value) == ("parallelism.pp: stage 0 of 4 cannot be cut from m: num_stages: 4 stages cannot be cut "
                                "from 2 blocks; allowed: 1 to 2")


def test_a_stage_keeps_the_whole_models_names_and_shares_its_parameters() -> None:
    from runner.models.gpt import GPT

    model = GPT(vocab_size=16, n_layer=3, n_embd=8, n_head=2)
    whole = dict(model.named_parameters(remove_duplicate=False))
    first, last = model.pipeline_stage(0, 2), model.pipeline_stage(1, 2)
    names = [set(dict(s.named_parameters(remove_duplicate=False))) for s in (first, last)]
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in names[0]} == \
        {"wte", "wpe", "blocks.0", "blocks.1"}
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in names[1]} == \
        {"blocks.2", "ln_f", "lm_head"}
    assert names[0] | names[1] == set(whole)
    assert all(p is whole[n] for s in (first, last) for n, p in s.named_parameters(remove_duplicate=False))
    x = torch.randint(0, 16, (2, 5))
    torch.testing.assert_close(last(first(x)), model(x), rtol=0, atol=0)  # the model itself is untouched


def _fit_reporting_tied_state(rank: int, world: int, overrides: list[str], run_dir: str, db: str | None) -> dict:
    """This rank's tied weight (its numel) and the numels of the optimizer state kept for it: the state of whichever
    optimizer parameter views the weight's memory (the weight itself, or a share of its rows)."""
    from runner.tracking.tracker import build_tracker

    spec = compose_spec(overrides, Path(run_dir), tracking_uri=f"sqlite:///{db}" if db else None)
    engine = Engine(spec, build_tracker(spec) if rank == 0 and db else None, DistEnv(rank, world, rank))
    engine.fit()
    named = dict(engine.module.named_parameters(remove_duplicate=False))
    tied = next(named[n] for n in ("wte.weight", "lm_head.weight") if n in named)
    memory = tied.untyped_storage().data_ptr()
    held = [p for group in engine.optimizer.param_groups for p in group["params"]
            if p.untyped_storage().data_ptr() == memory]
    return {"weight": tied.numel(), "state": {field: t.numel() for p in held
                                              for field, t in engine.optimizer.state[p].items() if t.dim() > 0}}


def test_pp2_splits_the_tied_weights_optimizer_state_by_rows_and_trains_like_one_process(tmp_path: Path,
                                                                                         two_ranks) -> None:
    """gpt's tied embedding and lm head, held by both stages: each stage's optimizer keeps the weight's state for its
    half of the rows only (parallel/tied_rows.py: AdamW's two moments, SGD's momentum), and the run still ends as one
    process's: weights, the logged train/loss, val/loss, test metrics and lr, and the checkpoint's whole optimizer
    state (each stage wrote its rows). Compared under SGD with momentum and weight decay (the module docstring: Adam
    blows rounding noise up); AdamW's state sizes are read from a run of its own."""
    common = [*GPT, "dataset.batch_size=8", "trainer.max_steps=4"]
    assert_like_one_process(tmp_path, common, ["parallelism.pp_schedule=1f1b", "parallelism.pp_microbatches=2"],
                            two_ranks=two_ranks)
    one, two = (checkpoint.load(tmp_path / d / "checkpoints" / "last.pt")["optimizer"]["state"] for d in ("one", "two"))
    assert set(one) == set(two)
    for name in one:
        for field in one[name]:
            torch.testing.assert_close(two[name][field], one[name][field], rtol=1e-5, atol=1e-7, msg=f"{name} {field}")
    for optimizer, fields in (("sgd", ("momentum_buffer",)), ("adamw", ("exp_avg", "exp_avg_sq"))):
        reports = two_ranks.run(_fit_reporting_tied_state, [*common, *PP2, f"optimizer={optimizer}"],
                                str(tmp_path / optimizer), None)
        for report in reports:
            assert report["state"] == {field: report["weight"] // 2 for field in fields}, optimizer
