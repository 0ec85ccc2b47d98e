"""The parallel dimensions (runner/engine/parallel/mesh.py): degrees resolved against the processes, the
data-parallel rank of each process, the model wrapped by dimension (not by the preset's name), hsdp on
four real processes (gloo on CPU), and the one-line refusals."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from runner.engine.engine import Engine
from runner.engine.parallel import DistEnv, ParallelDims, resolve_dims
from runner.specs.parallelism import ParallelismSpec
from runner.specs.run import SpecError
from tests.conftest import compose_spec, run_cli
from tests.runner.engine.test_parallel import SMALL, assert_same, final_weights, metric_history


@pytest.mark.parametrize("preset, degrees, world, expected", [
    ("single", {}, 1, {}),
    ("ddp", {}, 4, {"dp_replicate": 4}),
    ("fsdp", {}, 4, {"dp_shard": 4}),
    ("hsdp", {}, 4, {"dp_replicate": 2, "dp_shard": 2}),
    ("hsdp", {}, 8, {"dp_replicate": 2, "dp_shard": 4}),
    ("hsdp", {"dp_replicate": 3, "dp_shard": 2, "nproc_per_node": 6}, 6, {"dp_replicate": 3, "dp_shard": 2}),
    ("ddp", {"dp_replicate": 1, "dp_shard": -1}, 2, {"dp_shard": 2}),  # the degrees decide, not the name
])
def test_degrees_resolve_against_the_processes_with_minus_one_taking_the_rest(
        tmp_path: Path, preset: str, degrees: dict, world: int, expected: dict) -> None:
    par = compose_spec([f"parallelism={preset}", *(f"parallelism.{k}={v}" for k, v in degrees.items())],
                       tmp_path / "run").parallelism
    dims = resolve_dims(par, world)
    assert dims == ParallelDims(**expected)
    assert dims.world == world and dims.dp == world  # every process is a data-parallel replica (no tp/pp/cp yet)


@pytest.mark.parametrize("degrees, world, message", [
    ({"dp_replicate": 2, "dp_shard": 1}, 4, "parallelism: the degrees make 2 process(es) (dp_replicate=2) but the run "
                                            "has 4; their product must equal the number of processes"),
    ({"dp_replicate": 2, "dp_shard": 3}, 4, "parallelism: the degrees make 6 process(es) (dp_replicate=2 x dp_shard=3)"),
    ({"dp_replicate": 3, "dp_shard": -1}, 4, "parallelism.dp_shard: -1 takes the processes the other degrees leave, "
                                             "but 4 process(es) do not divide by 3 (dp_replicate=3 x dp_shard=-1)"),
    ({"dp_replicate": -1, "dp_shard": -1}, 4, "parallelism.dp_shard: -1, but parallelism.dp_replicate is -1 already"),
    ({"dp_shard": 0}, 4, "parallelism.dp_shard: 0 is not a degree; allowed: a positive number of processes, or -1"),
])
def test_degrees_that_do_not_make_the_processes_are_refused_in_one_line(degrees: dict, world: int, message: str) -> None:
    with pytest.raises(SpecError) as e:
        resolve_dims(ParallelismSpec(name="ddp", nproc_per_node=world, **degrees), world)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_data_parallel_rank_follows_the_mesh_layout() -> None:
    """Row-major over (pp, dp_replicate, dp_shard, cp, tp), as init_device_mesh lays the ranks out: ranks of
    one tensor-parallel group share a dp rank, and so read the same samples."""
    assert [ParallelDims(dp_replicate=2, dp_shard=2).dp_rank(r) for r in range(4)] == [0, 1, 2, 3]
    hybrid = ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    assert [hybrid.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert hybrid.dp == 4 and hybrid.world == 8 and hybrid.enabled() == ("dp_replicate", "dp_shard", "tp")
    mesh = torch.arange(8).view(2, 2, 2)  # (dp_replicate, dp_shard, tp): init_device_mesh's layout
    assert [hybrid.coordinates(int(mesh[a, b, c]))["dp_shard"] for a in range(2) for b in range(2) for c in range(2)] \
        == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.slow  # a CLI process for the refusal; resolve_dims's own refusals are the unit test above
def test_a_mismatch_of_degrees_and_processes_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    proc = run_cli(["parallelism=hsdp", "parallelism.nproc_per_node=2", "parallelism.dp_replicate=2",
                    "parallelism.dp_shard=2", "tracking=none"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: parallelism: the degrees make 4 process(es) (dp_replicate=2 x dp_shard=2) "
                                   "but the run has 2 (nproc_per_node=2 x nnodes=1); their product must equal the "
                                   "number of processes (or set one degree to -1 for the rest)")
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("checkpoints"))


def _wrapped(rank: int, world: int, cases: dict[str, list[str]], where: str) -> list[tuple]:
    got = []
    for name, overrides in cases.items():
        spec = compose_spec([*SMALL, "dataset.batch_size=8", "trainer.max_steps=1", "trainer.memory_estimate=false",
                             *overrides], Path(where) / name)
        engine = Engine(spec, env=DistEnv(rank, world, rank))
        weight = next(engine.module.parameters())
        mesh = getattr(weight, "device_mesh", None)
        got.append((rank, name, type(engine.model).__name__, mesh.mesh_dim_names if mesh is not None else None,
                    engine.env.dp_degree, engine.env.dp_rank))
    return got


def test_the_model_is_wrapped_by_its_dimensions_not_by_the_presets_name(tmp_path: Path, two_ranks) -> None:
    cases = {"ddp named, sharded": ["parallelism=ddp", "parallelism.dp_replicate=1", "parallelism.dp_shard=-1"],
             "fsdp named, replicated": ["parallelism=fsdp", "parallelism.dp_replicate=-1", "parallelism.dp_shard=1"]}
    got = sorted(g for report in two_ranks.run(_wrapped, cases, str(tmp_path)) for g in report)
    sharded = [g for g in got if g[1] == "ddp named, sharded"]
    replicated = [g for g in got if g[1] == "fsdp named, replicated"]
    assert all(g[2].startswith("FSDP") for g in sharded) and {g[3] for g in sharded} == {("dp_shard",)}
    assert {g[2] for g in replicated} == {"DistributedDataParallel"} and {g[3] for g in replicated} == {None}
    assert [(g[0], g[4], g[5]) for g in sharded] == [(0, 2, 0), (1, 2, 1)]


@pytest.mark.slow  # four gloo processes: about 2 minutes on two cores
def test_hsdp_on_four_processes_trains_and_logs_like_one_process(tmp_path: Path) -> None:
    """2 replicas x 2 shards (FSDP2 on a 2-D mesh), 4 gloo processes at a micro-batch of 8: the weights and
    every logged train/loss of one process at 32."""
    args = [*SMALL, "trainer.max_epochs=1", "trainer.log_every_n_steps=5", "model.hidden=[32]"]
    one = run_cli([*args, "dataset.batch_size=32", f"hydra.run.dir={tmp_path / 'one'}",
                   f"tracking.uri=sqlite:///{tmp_path / 'one.db'}", f"tracking.artifact_root={tmp_path / 'a1'}"],
                  cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    four = run_cli([*args, "parallelism=hsdp", "dataset.batch_size=8", f"hydra.run.dir={tmp_path / 'four'}",
                    f"tracking.uri=sqlite:///{tmp_path / 'four.db'}", f"tracking.artifact_root={tmp_path / 'a4'}"],
                   cwd=tmp_path, timeout=400)
    assert four.returncode == 0, four.stderr
    assert_same(final_weights(tmp_path / "four"), final_weights(tmp_path / "one"))
    single, hsdp = metric_history(tmp_path / "one.db"), metric_history(tmp_path / "four.db")
    assert len(single["train/loss"]) == 5  # 800 samples / 32 = 25 steps, logged every 5
    assert [s for s, _ in hsdp["train/loss"]] == [s for s, _ in single["train/loss"]]
    for (_, a), (_, b) in zip(single["train/loss"], hsdp["train/loss"]):
        assert b == pytest.approx(a, rel=1e-5)
    with sqlite3.connect(tmp_path / "four.db") as con:
        tags = dict(con.execute("select key, value from tags"))
    assert (tags["world_size"], tags["dp_degree"], tags["global_batch_size"]) == ("4", "4", "32")


def test_a_degree_above_one_under_single_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as e:
        compose_spec(["parallelism.dp_shard=2"], tmp_path / "run")
    assert str(e.value) == ("parallelism.dp_shard: 2 needs several processes but parallelism=single runs one; "
                            "add parallelism=ddp, fsdp or hsdp")
    assert not (tmp_path / "run").exists()


def _one_replica(rank: int, world: int) -> tuple:
    from runner.engine.parallel import global_count, place

    env = place(DistEnv(rank, world, rank), ParallelismSpec(name="single", tp=2), torch.device("cpu"))
    return (rank, env.dp_degree, env.dp_rank, int(global_count(3 + rank, torch.device("cpu"))),
            env.submesh("tp").size(), env.submesh("dp_shard"))


def test_a_replica_on_every_process_counts_its_own_samples_alone(tmp_path: Path, two_ranks) -> None:
    """tp=2 under single: both ranks hold one replica's batch, so the step's count is each rank's own,
    not the sum over the two processes (the data-parallel group is the rank alone)."""
    got = two_ranks.run(_one_replica)
    assert got == [(0, 1, 0, 3, 2, None), (1, 1, 0, 4, 2, None)]
