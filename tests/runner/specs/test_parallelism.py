"""The parallelism group's rules (runner/specs/parallelism.py): how many processes a spec starts (single with
model-parallel degrees included), the degrees against those processes, the tensor/pipeline/context keys
that need their dimension, and context parallelism's refusals (runner/engine/parallel/context.py). The
one-line CLI refusals (exit 2, nothing made) are cases of tests/runner/test_bad_input.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.specs.parallelism import ParallelismSpec, PlanSpec, check_parallelism, nominal_world
from runner.specs.run import SpecError
from tests.conftest import compose_spec

GPT = ["model=gpt", "dataset=synthetic_tokens", "task=language_modeling", "dataset.vocab_size=64",
       "dataset.block_size=16", "dataset.size=32"]


@pytest.mark.parametrize("overrides, world", [
    ([], 1),
    (["parallelism.tp=2"], 2),                                        # single: one replica on tp x pp x cp
    (["parallelism.pp=4", "parallelism.pp_schedule=interleaved_1f1b", "parallelism.pp_microbatches=8"], 4),
    (["parallelism.tp=2", "parallelism.pp=2"], 4),
    (["parallelism=fsdp", "parallelism.nproc_per_node=8", "parallelism.tp=2"], 8),  # 4-way FSDP x 2-way TP
    (["parallelism=hsdp", "parallelism.dp_replicate=2"], 4),
    (["parallelism=ddp", "parallelism.nproc_per_node=4", "parallelism.nnodes=2"], 8),
])
def test_the_issues_commands_start_the_processes_their_degrees_make(tmp_path: Path, overrides: list[str],
                                                                    world: int) -> None:
    from runner.engine.parallel import resolve_dims

    par = compose_spec(overrides, tmp_path / "run").parallelism
    assert nominal_world(par) == world
    assert resolve_dims(par, world).world == world


def test_under_single_the_model_parallel_degrees_leave_one_data_parallel_replica(tmp_path: Path) -> None:
    from runner.engine.parallel import ParallelDims, resolve_dims

    par = compose_spec(["parallelism.tp=2", "parallelism.pp=2"], tmp_path / "run").parallelism
    dims = resolve_dims(par, nominal_world(par))
    assert dims == ParallelDims(pp=2, tp=2) and dims.dp == 1


def test_fsdp_by_tp_resolves_the_shards_from_the_processes_left(tmp_path: Path) -> None:
    from runner.engine.parallel import ParallelDims, resolve_dims

    par = compose_spec(["parallelism=fsdp", "parallelism.nproc_per_node=8", "parallelism.tp=2"], tmp_path / "run").parallelism
    assert resolve_dims(par, nominal_world(par)) == ParallelDims(dp_shard=4, tp=2)


@pytest.mark.parametrize("overrides, message", [
    (["parallelism=fsdp", "parallelism.nproc_per_node=8", "parallelism.dp_shard=2", "parallelism.tp=2"],
     "parallelism: the degrees make 4 process(es) (dp_shard=2 x tp=2) but the run has 8 (nproc_per_node=8 x nnodes=1); "
     "their product must equal the number of processes (or set one degree to -1 for the rest)"),
    (["parallelism=fsdp", "parallelism.tp=3"], "parallelism.dp_shard: -1 takes the processes the other degrees leave, "
     "but 2 process(es) (nproc_per_node=2 x nnodes=1) do not divide by 3 (dp_shard=-1 x tp=3); make the degrees' product 2"),
    (["parallelism=fsdp", "parallelism.pp=-1"], "parallelism.dp_shard: -1, but parallelism.pp is -1 already; at most "
     "one degree takes the processes left"),
    (["parallelism.tp=-1"], "parallelism.tp: -1 takes the processes the other degrees leave, but parallelism=single "
     "starts tp x pp x cp processes; give a number of processes"),
    (["parallelism.pp=0"], "parallelism.pp: 0 is not a degree; allowed: a positive number of processes, or -1"),
    (["parallelism.dp_replicate=2", "parallelism.tp=2"], "parallelism.dp_replicate: 2 needs several processes but "
     "parallelism=single runs one; add parallelism=ddp, fsdp or hsdp"),
])
def test_degrees_that_do_not_make_the_processes_are_refused_when_the_spec_is_built(
        tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError) as e:
        compose_spec(overrides, tmp_path / "run")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_torchrun_started_by_hand_decides_its_processes_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a user's own torchrun the process group, not nproc_per_node, is the world: place() checks it."""
    par = ParallelismSpec(name="ddp", dp_replicate=4, nproc_per_node=2)
    with pytest.raises(SpecError, match="the degrees make 4 process"):
        check_parallelism(par)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "by-hand")
    check_parallelism(par)


@pytest.mark.parametrize("degrees, keys, message", [
    ({}, {"tp_plan": PlanSpec("pkg.plan")}, "parallelism.tp_plan: set, but parallelism.tp=1 splits no layer"),
    ({}, {"sequence_parallel": False}, "parallelism.sequence_parallel: false, but parallelism.tp=1 splits no layer"),
    ({}, {"loss_parallel": False}, "parallelism.loss_parallel: false, but parallelism.tp=1"),
    ({}, {"pp_plan": PlanSpec("pkg.stage")}, "parallelism.pp_plan: set, but parallelism.pp=1 cuts no pipeline"),
    ({}, {"pp_schedule": "gpipe"}, "parallelism.pp_schedule: gpipe, but parallelism.pp=1 cuts no pipeline"),
    ({}, {"pp_microbatches": 4}, "parallelism.pp_microbatches: 4, but parallelism.pp=1"),
    ({}, {"pp_stages_per_rank": 1}, "parallelism.pp_stages_per_rank: 1, but parallelism.pp=1"),
    ({"pp": 2}, {"pp_schedule": "gpipe", "pp_stages_per_rank": 2}, "parallelism.pp_stages_per_rank: 2, but "
     "pp_schedule=gpipe holds one stage per rank"),
    ({"pp": 2}, {"pp_stages_per_rank": 2}, "parallelism.pp_stages_per_rank: 2, but pp_schedule=1f1b holds one"),
    *[({"pp": 2}, {"pp_schedule": s, "pp_stages_per_rank": 1}, f"parallelism.pp_stages_per_rank: 1, but pp_schedule={s} "
       "holds several stages per rank") for s in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")],
    *[({"pp": 2}, {"pp_schedule": "zbv_zero_bubble", "pp_stages_per_rank": n}, f"parallelism.pp_stages_per_rank: {n}, "
       "but pp_schedule=zbv_zero_bubble holds exactly 2 stages per rank") for n in (1, 3)],
    ({"pp": 2}, {"pp_microbatches": 9}, "parallelism.pp_microbatches: 9 micro-batches cannot be cut from a batch of 8 "
     "(dataset.batch_size, per data-parallel rank); allowed: 1 to 8"),
])
def test_model_parallel_keys_are_refused_in_one_line(degrees: dict, keys: dict, message: str) -> None:
    par = ParallelismSpec(name="single", **degrees, **keys)
    with pytest.raises(SpecError) as e:
        check_parallelism(par, batch_size=8)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("degrees, keys", [
    ({"pp": 2}, {"pp_schedule": "gpipe", "pp_stages_per_rank": 1, "pp_microbatches": 8}),
    ({"pp": 2}, {"pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 3}),
    ({"pp": 2}, {"pp_schedule": "looped_bfs"}),  # -1: 2 stages per rank
    ({"pp": 2}, {"pp_schedule": "zbv_zero_bubble", "pp_stages_per_rank": 2}),
    ({"tp": 2}, {"tp_plan": PlanSpec("pkg.plan"), "sequence_parallel": False, "loss_parallel": False}),
    ({"tp": 2, "pp": 2}, {"pp_plan": PlanSpec("pkg.stage")}),
])
def test_model_parallel_keys_with_their_dimension_pass(degrees: dict, keys: dict) -> None:
    check_parallelism(ParallelismSpec(name="single", **degrees, **keys), batch_size=8)


def test_context_parallelism_on_a_cpu_is_refused_naming_the_key(tmp_path: Path) -> None:
    from runner.engine.parallel.context import check_context_parallel

    with pytest.raises(SpecError) as e:
        compose_spec([*GPT, "parallelism.cp=2", "trainer.device=cpu"], tmp_path / "run")
    assert str(e.value).startswith("parallelism.cp: 2, but context parallelism needs CUDA")
    spec = compose_spec(GPT, tmp_path / "run").replace(parallelism=ParallelismSpec(name="single", cp=2))
    with pytest.raises(SpecError, match=r"^parallelism.cp: 2, but context parallelism needs CUDA .* this run's device is cpu"):
        check_context_parallel(spec, torch.device("cpu"))


def test_context_parallelism_needs_a_torch_that_has_it_and_a_model_that_takes_positions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked as on a GPU (the device passed in): gpt passes, an MLP is refused, a torch without
    context_parallel is refused."""
    from runner.engine.parallel import context

    cuda = torch.device("cuda", 0)
    gpt = compose_spec(GPT, tmp_path / "gpt").replace(parallelism=ParallelismSpec(name="single", cp=2))
    context.check_context_parallel(gpt, cuda)
    mlp = compose_spec([], tmp_path / "mlp").replace(parallelism=ParallelismSpec(name="single", cp=2))
    with pytest.raises(SpecError) as e:
        context.check_context_parallel(mlp, cuda)
    assert str(e.value) == ("parallelism.cp: 2, but model runner.models.mlp.MLP has no context-parallel attention (its "
                            "forward takes no `positions` to shard with the tokens); use model=gpt or parallelism.cp=1")
    with pytest.raises(SpecError, match="^parallelism.cp: model my.builder has no context-parallel attention"):
        context.check_model(torch.nn.Linear(2, 2), "my.builder")
    monkeypatch.setattr(context, "has_context_parallel", lambda: False)
    with pytest.raises(SpecError, match=r"^parallelism.cp: 2, but torch .* lacks context parallelism"):
        context.check_context_parallel(gpt, cuda)


def test_without_context_parallelism_a_step_computes_on_its_own_batch() -> None:
    from runner.engine.parallel import context
    from runner.tasks import Batch

    batch = Batch(torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
    with context.for_step(None, batch) as shard:
        assert shard is batch
    loss = torch.tensor(3.0)
    assert context.whole_sequence(loss, None) is loss


def test_gpt_positions_given_are_the_positions_it_would_compute() -> None:
    """The argument context parallelism shards: passing arange(T) is the forward without it."""
    from models.gpt import GPT as Model

    torch.manual_seed(0)
    model = Model(vocab_size=32, max_length=16)
    ids = torch.randint(0, 32, (2, 16))
    assert torch.equal(model(ids), model(ids, positions=torch.arange(16)))
    assert not torch.equal(model(ids), model(ids, positions=torch.arange(16).flip(0)))
