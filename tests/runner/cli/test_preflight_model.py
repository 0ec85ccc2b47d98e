"""What the model decides about a sharded or cut run, refused by the CLI before anything exists
(runner/cli/preflight_model.py): each command is run as a user types it, in an empty working directory, and
must end with one `error:` line naming the key, the value and what is allowed, exit code 2, no traceback, no
worker started, and nothing created there (no outputs/, no dated run folder). Then the pipeline's check that
stages compute the model's forward (runner/engine/parallel/pipeline_checks.py): a residual added outside the
block is refused, one added inside trains like one process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, compose_spec, run_cli

LM = ["task=language_modeling", "model=gpt", "dataset=synthetic_tokens", "model.n_layer=2", "model.n_embd=16",
      "model.n_head=2", "dataset.batch_size=8"]
CNN = ["model=cnn", "dataset=synthetic", "dataset.shape=[1,8,8]", "dataset.batch_size=8"]
MLP_STAGES = "parallelism.pp_plan={_target_:tests.user_pkg.stages.mlp_stage}"

# (the command, what its one line must say: the key, the value, what is allowed)
REFUSED = {
    "pp on the default mlp": (["parallelism.pp=2"], [
        "error: parallelism.pp: runner.models.mlp.MLP has no pipeline plan (no pipeline_stage method)",
        "set parallelism.pp_plan=", "or use parallelism.pp=1"]),
    "pp above the model's blocks": ([*LM, "parallelism.pp=4"], [
        "error: parallelism.pp: stage 0 of 4 cannot be cut from runner.models.gpt.GPT", "allowed: 1 to 2"]),
    "a pp plan naming a missing part": ([*LM, "parallelism.pp=2", "parallelism.pp_plan={_target_:tests.user_pkg.stages.blocks_stage}"], [
        "error: parallelism.pp_plan: tests.user_pkg.stages.blocks_stage failed to cut stage 0 of 2",
        "GPT has no attribute `layers`", "allowed: a plan that names the model's own parts", "blocks"]),
    "1f1b with fewer micro-batches than stages": ([*LM, "parallelism.pp=2", "parallelism.pp_schedule=1f1b",
                                                   "parallelism.pp_microbatches=1"], [
        "error: parallelism.pp_microbatches: 1 with pp_schedule=1f1b", "allowed: 2 or more"]),
    "BatchNorm under tp": ([*CNN, "parallelism.tp=2"], [
        "error: model: runner.models.cnn.CNN's BatchNorm layer '1' with parallelism.tp=2", "use ddp or fsdp"]),
    "BatchNorm under pp with micro-batches": ([*CNN, "parallelism.pp=2", "parallelism.pp_microbatches=2", MLP_STAGES], [
        "error: model: runner.models.cnn.CNN's BatchNorm layer '1' with parallelism.pp_microbatches=2",
        "use parallelism.pp_microbatches=1"]),
    "fsdp of a model without blocks": (["model._target_=tests.user_pkg.blocks.Flat", "parallelism=fsdp",
                                        "parallelism.nproc_per_node=2"], [
        "error: parallelism: fsdp found no blocks to shard in Flat", "use parallelism=ddp"]),
    "a tp plan naming a missing part": (["parallelism.tp=2",
                                         'parallelism.tp_plan={_target_:tests.user_pkg.plans.column_then_row,column:"7"}'], [
        "error: parallelism.tp_plan: tests.user_pkg.plans.column_then_row names a part runner.models.mlp.MLP does not "
        "hold (Parallelize plan key '7' could not be resolved", "allowed: the model's own parts"]),
    "a residual outside the block": (["model._target_=tests.user_pkg.residual.OuterResidual", "parallelism.pp=2"], [
        "error: parallelism.pp: tests.user_pkg.residual.OuterResidual cut into 2 stages does not compute its own forward",
        "its block 'blocks.0'", "allowed: a forward that passes only each block's output on", "parallelism.pp=1"]),
    # its constructor reads a value: checked on a CPU build moved to the meta device
    "a residual outside the block, in a model the meta device cannot build": (
        ["model._target_=tests.user_pkg.residual.OuterResidualReadsOnBuild", "parallelism.pp=2"], [
            "error: parallelism.pp: tests.user_pkg.residual.OuterResidualReadsOnBuild cut into 2 stages does not compute "
            "its own forward", "its block 'blocks.0'", "parallelism.pp=1"]),
}


@pytest.fixture(autouse=True)
def _user_package_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user models and plans (tests.user_pkg) importable in `python -m runner`, as a user's own project is
    (PYTHONPATH or an install): the CLI's runs start in an empty temporary directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def resolved(overrides: list[str], run_dir: Path):
    """The spec as preflight checks it: its components' arguments resolved against their callables."""
    from runner.specs import components
    from runner.specs.resume import typed_keys

    spec = compose_spec(overrides, run_dir)
    return components.resolved_spec(spec, typed_keys(spec.overrides))


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_composition_is_one_line_exit_2_before_any_worker_or_run_directory(tmp_path: Path, case: str) -> None:
    args, said = REFUSED[case]
    proc = run_cli(args, cwd=tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == 2, out[-3000:]
    assert len(lines) == 1, out[-3000:]  # no launcher line ("starting 2 workers"), no torch agent line, no warning
    assert "Traceback" not in out
    for part in said:
        assert part in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == [], f"the refused command made {sorted(p.name for p in tmp_path.rglob('*'))}"


def test_a_forward_that_cannot_be_traced_is_said_in_one_warning_line(tmp_path: Path) -> None:
    """A forward reading its input's values cannot run on the meta device: the check says what it cannot know."""
    from runner.cli import preflight_model

    said: list[str] = []
    spec = resolved(["model._target_=tests.user_pkg.residual.ReadsValues", "parallelism.pp=2"], tmp_path / "run")
    preflight_model.check_model_composition(spec, say=said.append)
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("parallelism.pp: tests.user_pkg.residual.ReadsValues's forward cannot be traced on the "
                              "meta device"), said[0]
    assert "a residual added outside a block would be counted twice" in said[0]


def test_a_residual_inside_the_block_passes_the_check_and_trains_like_one_process(tmp_path: Path, two_ranks) -> None:
    from runner.cli import preflight_model
    from tests.runner.engine.test_pipeline_parallel import assert_like_one_process

    common = ["dataset=synthetic", "dataset.shape=[1,4,4]", "dataset.size=60", "dataset.num_classes=3",
              "dataset.batch_size=8", "model._target_=tests.user_pkg.residual.InnerResidual",
              "optimizer=sgd", "trainer.max_epochs=1", "trainer.progress_bar=off", "trainer.eval_every_n_steps=3",
              "trainer.log_every_n_steps=1"]
    pp = ["parallelism.pp_schedule=gpipe", "parallelism.pp_microbatches=2"]
    said: list[str] = []
    spec = resolved([*common, "parallelism.pp=2", *pp], tmp_path / "check")
    preflight_model.check_model_composition(spec, say=said.append)  # neither refused nor said
    assert said == []
    assert_like_one_process(tmp_path, common, pp, two_ranks=two_ranks)


# --- under the user's own torchrun: the same checks on every rank, in preflight and in the engine's build ----------

UNDER_TORCHRUN = {k: REFUSED[k] for k in ("a residual outside the block", "a tp plan naming a missing part")}


@pytest.mark.parametrize("case", list(UNDER_TORCHRUN))
def test_under_the_users_torchrun_a_bad_composition_is_refused_on_every_rank_before_anything(
        tmp_path: Path, migrated_mlflow_store: Path, case: str) -> None:
    """`torchrun --nproc-per-node 2 -m runner ...`: preflight's model check used to be skipped there and the engine
    never ran it, so the residual trained x + x without a word and the plan's missing part failed mid-step in a
    traceback. Each rank says the one line; no rank trains, nothing is created, no MLflow run is left."""
    import shutil

    from mlflow.tracking import MlflowClient

    args, said = UNDER_TORCHRUN[case]
    work, db = tmp_path / "work", tmp_path / "mlflow.db"
    work.mkdir()
    shutil.copy(migrated_mlflow_store, db)
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "runner", *args, "trainer.device=cpu", "trainer.max_steps=2",
                           "trainer.progress_bar=off", f"tracking.uri=sqlite:///{db}",
                           f"tracking.artifact_root={tmp_path / 'artifacts'}"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0, out[-3000:]
    # one line per rank that says it (torchrun ends the other rank once one has exited, maybe before its line)
    assert 1 <= len(errors) <= 2 and len(set(errors)) == 1, out[-3000:]
    for part in said:
        assert part in errors[0], errors[0]
    assert f'File "{REPO / "runner"}' not in out  # torchrun's own report of its failed ranks is torchrun's
    assert "trained" not in out
    assert list(work.iterdir()) == [], sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    client = MlflowClient(f"sqlite:///{db}")
    assert [r.info.status for e in client.search_experiments() for r in client.search_runs([e.experiment_id])] == []


def _engine_build_on_rank(rank: int, world: int, overrides: list[str], run_dir: str) -> str | None:
    from runner.engine.engine import Engine
    from runner.engine.parallel import DistEnv
    from runner.specs.run import SpecError

    try:
        Engine(compose_spec(overrides, Path(run_dir)), env=DistEnv(rank, world, rank))
    except SpecError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", list(UNDER_TORCHRUN))
def test_every_ranks_engine_build_refuses_what_preflight_refuses(tmp_path: Path, case: str, two_ranks) -> None:
    """The engine runs preflight's checks as it builds, on every rank, with the degrees of its process group: a run
    started without this command line's preflight (the engine built by hand, a runner of one's own) is refused in
    the same line. The engine used to build the residual's stages and the plan's half-split model."""
    args, said = UNDER_TORCHRUN[case]
    refusals = two_ranks.run(_engine_build_on_rank, [*args, "trainer.device=cpu"], str(tmp_path / "run"))
    assert refusals[0] is not None and refusals == [refusals[0]] * 2, refusals
    for part in said:
        assert part in f"error: {refusals[0]}", refusals[0]
