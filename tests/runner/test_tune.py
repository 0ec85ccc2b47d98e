"""The finders (runner/tune/): the lr finder on least squares, whose divergence lr is known (2/L), the
batch-size finder against a model that runs out of memory above a known batch, and what each records."""
from __future__ import annotations

import math
import subprocess
import sys
import sqlite3
import weakref
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from runner import tune
from runner.engine.engine import Engine
from runner.cli.launch import run_in_process
from runner.engine.parallel import DistEnv
from runner.specs.accumulation import AccumulationSpec
from runner.specs.dataset import DatasetSpec
from runner.specs.model import ModelSpec
from runner.specs.run import RunSpec
from runner.specs.tune import TuneSpec
from runner.tune import batch_size, lr_find
from tests.conftest import compose_spec, run_cli

USER_CONF = Path(__file__).resolve().parents[1] / "user_pkg" / "conf"
FAST = ["trainer.eval_every_epoch=false", "trainer.progress_bar=off"]


def least_squares(run_dir: Path, *overrides: str) -> Engine:
    """Full-batch gradient descent on linear least squares (140 samples, 6 features + bias, 2 outputs)."""
    return Engine(compose_spec([f"hydra.searchpath=[file://{USER_CONF}]", "dataset=linear_targets", "task=regression",
                                "model.hidden=[]", "optimizer=sgd", "optimizer.momentum=0", "optimizer.weight_decay=0",
                                "dataset.batch_size=140", "tune=lr_find", *FAST, *overrides], run_dir))


def test_lr_find_on_least_squares_sees_divergence_begin_at_2_over_L_and_suggests_below_it(tmp_path: Path) -> None:
    engine = least_squares(tmp_path, "tune.min_lr=1e-3", "tune.max_lr=10", "tune.steps=100")
    x = engine.train_loader.dataset.tensors[0].double()
    features = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    # the loss is the mean over samples of half the squared error summed over the 2 outputs: per output,
    # a quadratic with Hessian X^T X / N; gradient descent diverges above 2 / its largest eigenvalue
    diverges = 2 / torch.linalg.eigvalsh(features.T @ features / len(x)).max().item()
    curve = lr_find.find_lr(engine, engine.spec.tune)
    found = lr_find.suggest(curve)
    assert curve.diverged_at is not None and curve.stop_reason.startswith("the smoothed loss passed 4 x")
    assert 0.7 * diverges < found.lowest_lr < 1.5 * diverges  # where the loss turns up: divergence begins
    assert diverges < curve.diverged_at < 6 * diverges          # the stop rule needs the loss 4x up: later
    assert found.lr < 0.5 * diverges and found.lr == float(f"{found.steepest_lr:.2g}")
    assert found.slope < 0


def test_the_sweep_stops_at_the_first_non_finite_loss_and_pairs_each_loss_with_the_lr_before_it() -> None:
    losses = iter([5.0, 4.0, 3.0, 2.0, math.nan, 1.0])
    curve = lr_find.sweep(lambda lr: next(losses), [1, 2, 3, 4, 5, 6], smoothing=0.0, diverge_factor=4)
    assert curve.lrs == [1, 2, 3, 4] and curve.losses[:3] == [4.0, 3.0, 2.0] and math.isnan(curve.losses[3])
    assert curve.diverged_at == 4 and curve.stop_reason == "the loss stopped being finite"
    losses = iter([9.0, 4.0, 2.0, 100.0])
    curve = lr_find.sweep(lambda lr: next(losses), [1, 2, 3, 4], smoothing=0.5, diverge_factor=4)
    # bias-corrected: the first value is the loss itself; 100 lifts the average past 4 x its best
    assert curve.smoothed[:2] == [4.0, (0.25 * 4 + 0.5 * 2) / 0.75] and curve.diverged_at == 3


def test_lr_find_puts_weights_optimizer_and_random_streams_back_bitwise(tmp_path: Path) -> None:
    engine = Engine(compose_spec([*FAST, "optimizer=adamw", "+accum=2", "trainer.max_steps=2", "tune=lr_find",
                                  "tune.steps=12"], tmp_path))
    engine.fit()  # an optimizer with state to put back
    model = {k: v.clone() for k, v in engine.module.state_dict().items()}
    optimizer = engine.optimizer.state_dict()
    state = {id_: {k: v.clone() for k, v in s.items()} for id_, s in optimizer["state"].items()}
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    rng = torch.get_rng_state()
    curve = lr_find.find_lr(engine, engine.spec.tune)
    assert len(curve.lrs) >= 8 and curve.diverged_at is not None  # the sweep ran until the weights were ruined
    for key, value in engine.module.state_dict().items():
        assert torch.equal(value, model[key]), key
    after = engine.optimizer.state_dict()
    assert after["state"].keys() == state.keys()
    for id_, s in after["state"].items():
        for k, v in s.items():
            assert torch.equal(v, state[id_][k]), (id_, k)
    assert [g["lr"] for g in engine.optimizer.param_groups] == lrs
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in engine.module.parameters())


def test_lr_find_with_apply_trains_as_the_printed_override_would_and_records_it(tmp_path: Path, sqlite_uri: str,
                                                                                 capsys: pytest.CaptureFixture) -> None:
    args = [*FAST, "trainer.max_steps=3", "scheduler=onecycle", "tune=lr_find", "tune.steps=20", "tune.apply=true"]
    spec = compose_spec(args, tmp_path / "tuned", tracking_uri=sqlite_uri)
    tuned = run_in_process(spec, DistEnv())
    out = capsys.readouterr().out
    override = next(line for line in out.splitlines() if "suggested: " in line).split("suggested: ")[1].split()[0]
    assert override.startswith("optimizer.lr=") and "the peak of the one-cycle schedule" in out
    lr = float(override.split("=")[1])
    written = RunSpec.from_yaml((tmp_path / "tuned" / "spec.yaml").read_text())
    assert written.optimizer.lr == lr and written.tune.name is None  # what was trained, the finder off
    plain = run_in_process(compose_spec([*args[:4], override], tmp_path / "plain"), DistEnv())
    assert tuned.final == plain.final and tuned.objective == plain.objective and tuned.steps == 3
    assert (tmp_path / "tuned" / "lr_find.png").stat().st_size > 10_000
    db = Path(sqlite_uri.removeprefix("sqlite:///"))
    with sqlite3.connect(db) as con:
        run_id, status = con.execute("select run_uuid, status from runs").fetchone()
        params = dict(con.execute("select key, value from params where run_uuid=?", (run_id,)))
        tags = dict(con.execute("select key, value from tags where run_uuid=?", (run_id,)))
        curve = con.execute("select count(*) from metrics where key='tune/smoothed_loss'").fetchone()[0]
        lrs = con.execute("select count(*) from metrics where key='tune/lr'").fetchone()[0]
        suggested = con.execute("select value from metrics where key='tune/suggested_lr'").fetchone()[0]
    assert status == "FINISHED" and float(params["optimizer.lr"]) == lr and params["tune.name"] == "None"
    assert tags["tune.suggestion"] == override and tags["tune.before"] == "optimizer.lr=0.001"
    assert 5 < curve == lrs <= 19 and suggested == lr  # a point per step but the first, up to divergence
    artifacts = {p.name for p in (tmp_path / "artifacts").rglob("*") if p.is_file()}
    assert {"lr_find.png", "lr_find.txt"} <= artifacts


class RunsOutAbove(nn.Module):
    """A model that runs out of memory on a batch of more than `limit` samples, and notes each batch it sees."""

    seen: list[int] = []
    failed: list[weakref.ref] = []  # what each failing step held

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, limit: int = 37):
        super().__init__()
        self.limit = limit
        self.linear = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RunsOutAbove.seen.append(len(x))
        if len(x) > self.limit:
            waste = torch.empty(1 << 16)  # held by the failing frame: must be freed with it
            RunsOutAbove.failed.append(weakref.ref(waste))
            raise torch.OutOfMemoryError(f"out of memory at a batch of {len(x)}")
        return self.linear(x.flatten(1))


def test_batch_size_finder_finds_the_largest_batch_that_fits_by_doubling_then_bisecting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.0)
    spec = compose_spec([*FAST, "tune=batch_size", "tune.steps_per_candidate=1"], tmp_path)
    spec = spec.replace(model=ModelSpec(target=f"{__name__}.RunsOutAbove", params={"limit": 37}))
    engine = Engine(spec)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    RunsOutAbove.seen.clear()
    RunsOutAbove.failed.clear()  # building the engine counts FLOPs with one forward at the configured batch
    found = batch_size.find_batch_size(engine, spec.tune, until_oom=True)
    assert len(RunsOutAbove.failed) == 4 and all(ref() is None for ref in RunsOutAbove.failed)  # freed, no leak
    assert found.largest_fit == 37 and found.too_big == {64, 48, 40, 38}
    tried = list(dict.fromkeys(RunsOutAbove.seen))  # each batch in the order first tried
    assert tried == [2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]  # doubling, then the binary search
    assert sorted(found.throughput) == [2, 4, 8, 16, 32, 36, 37] and min(found.throughput.values()) > 0
    for key, value in engine.module.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert engine.train_loader.batch_sampler.batch_size == 64 and not engine.optimizer.state


def test_batch_search_on_a_cpu_stops_once_throughput_stops_rising_and_the_knee_is_within_tolerance() -> None:
    rates = {2: 100.0, 4: 190.0, 8: 300.0, 16: 310.0, 32: 312.0, 64: 200.0}
    found = batch_size.search(rates.get, cap=1000, tolerance=0.05, until_oom=False)
    assert sorted(found.throughput) == [2, 4, 8, 16, 32] and "stopped rising" in found.stopped
    assert batch_size.knee(found.throughput, 0.05) == 8      # 300 >= 0.95 x 312
    assert batch_size.knee(found.throughput, 0.0) == 32
    capped = batch_size.search(float, cap=12, tolerance=0.05, until_oom=False)  # rising with the batch
    assert sorted(capped.throughput) == [2, 4, 8, 12] and capped.stopped == "reached the cap of 12"


@pytest.mark.parametrize("batch, accum, world, found, expected", [
    (64, 1, 1, 256, (64, 1)),   # never above the global batch: accumulation stays 1
    (64, 1, 1, 16, (16, 4)),
    (48, 2, 2, 40, (32, 3)),    # 40 does not divide 96: the largest divisor below it
    (7, 1, 1, 4, (1, 7)),
])
def test_keep_global_batch_keeps_batch_x_accumulation_x_ranks(batch: int, accum: int, world: int, found: int,
                                                              expected: tuple[int, int]) -> None:
    spec = RunSpec(dataset=DatasetSpec(batch_size=batch), accumulation=AccumulationSpec(steps=accum),
                   tune=TuneSpec(name="batch_size", keep_global_batch=True))
    search = batch_size.BatchSearch(throughput={found: 1.0})
    applied, lines = batch_size.answer(spec, search, spec.tune, world)
    micro, steps = expected
    assert (applied.dataset.batch_size, applied.accumulation.steps) == expected
    assert micro * steps * world == batch * accum * world
    assert lines[0].startswith(f"  keeping the global batch of {batch * accum * world} (batch x accumulation x ranks): "
                               f"micro-batch {micro} x {steps} accumulation step(s) x {world}")
    assert lines[-1].startswith(f"  suggested: dataset.batch_size={micro}")


def test_batch_size_finder_reports_and_records_without_training(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.0)
    spec = compose_spec([*FAST, "tune=batch_size", "tune.max_batch_size=16", "tune.steps_per_candidate=1"], tmp_path)
    assert run_in_process(spec, DistEnv()) is tune.NOTHING_TRAINED
    out = capsys.readouterr().out
    # each candidate's rate is said once, as it is timed (issue 26, section 4: duplicated notices); the recorded
    # report keeps the list, which a resume prints
    assert "batch_size: samples/s by micro-batch per rank" not in out
    assert tune.read_finding(spec).lines[0].startswith("batch_size: samples/s by micro-batch per rank (1 rank(s), cpu): 2: ")
    assert "on a CPU only throughput counts" in out and "suggested: dataset.batch_size=" in out
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow  # ~20 s: two gloo workers; test_lr_find_with_apply_trains_as_the_printed_override_would keeps
def test_ddp_ranks_agree_on_one_suggestion_and_train_with_it(tmp_path: Path) -> None:  # the applied path in CI
    proc = run_cli(["parallelism=ddp", "parallelism.nproc_per_node=2", "trainer.device=cpu", "tracking=none",
                    "trainer.max_steps=2", *FAST, "tune=lr_find", "tune.steps=20", "tune.apply=true",
                    "hydra.run.dir=run"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "suggested: optimizer.lr=" in line]
    assert len(lines) == 1  # rank 0 reports; every rank trained with its answer (or the run would hang)
    lr = float(lines[0].split("optimizer.lr=")[1].split()[0])
    assert yaml.safe_load((tmp_path / "run" / "spec.yaml").read_text())["optimizer"]["lr"] == lr
    assert "trained 2 optimizer steps" in proc.stdout


def test_under_compile_the_batch_finder_times_every_candidate_compiled(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each candidate is timed as training would run it at that micro-batch: through the compiled model (the
    engine runs a batch other than dataset.batch_size uncompiled, which a candidate is not)."""
    from runner.engine import compiling

    monkeypatch.setattr(batch_size, "MIN_SECONDS", 0.0)
    monkeypatch.setattr(compiling, "BACKEND", "eager")  # the same guards and recompiles, no code generation
    spec = compose_spec([*FAST, "trainer.compile=true", "tune=batch_size", "tune.max_batch_size=16",
                         "tune.steps_per_candidate=1"], tmp_path)
    engine = Engine(spec)
    seen: dict[int, set[bool]] = {}
    for_batch = compiling.for_batch

    def noted(model, inputs, spec_):
        chosen = for_batch(model, inputs, spec_)
        seen.setdefault(len(inputs), set()).add(chosen is model and hasattr(model, "_orig_mod"))
        return chosen

    monkeypatch.setattr(compiling, "for_batch", noted)
    found = batch_size.find_batch_size(engine, spec.tune, until_oom=False)
    assert spec.dataset.batch_size not in found.throughput and sorted(found.throughput) == sorted(seen)
    assert seen == {b: {True} for b in found.throughput}  # every step of every candidate compiled
    assert engine.spec.dataset.batch_size == spec.dataset.batch_size  # the run's own spec is back


@pytest.mark.slow  # a real kill mid-sweep and a resume: ~15 s (True), ~80 s (False)
@pytest.mark.parametrize("apply", [True, False])
def test_a_finder_killed_mid_sweep_then_resumed_finds_again_and_trains_with_what_it_found(tmp_path: Path,
                                                                                           apply: bool) -> None:
    """A real SIGKILL in the sweep's 5th step; the resume reruns the finder (its result was never recorded), reports
    the suggestion, and with tune.apply=true trains with it (spec.yaml says so); with apply=false trains nothing."""
    args = ["tracking=none", "trainer.max_steps=3", *FAST, "tune=lr_find", "tune.steps=20", f"tune.apply={apply}",
            "hydra.run.dir=run"]
    killed = subprocess.run([sys.executable, str(Path(__file__).parent / "kill_at.py"), "step", "5", *args],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    findings = list((tmp_path / "run").glob("tune*.yaml"))  # killed before the finder finished: none recorded
    resumed = run_cli(["trainer.resume=run", "trainer.progress_bar=off"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (line,) = [line for line in resumed.stdout.splitlines() if "suggested: optimizer.lr=" in line]
    assert findings == []
    lr = float(line.split("optimizer.lr=")[1].split()[0])
    written = RunSpec.from_yaml((tmp_path / "run" / "spec.yaml").read_text())
    recorded = yaml.safe_load((tmp_path / "run" / tune.FINDING_FILE).read_text())
    assert recorded["suggestion"] == f"optimizer.lr={lr:g}"
    if apply:
        assert written.optimizer.lr == lr and written.tune.name is None and "trained 3 optimizer steps" in resumed.stdout
    else:
        assert written.optimizer.lr == 0.001 and "trained" not in resumed.stdout
        assert not (tmp_path / "run" / "checkpoints").exists()
        # the finished finder run resumed again: its recorded answer, reported without a second sweep
        written_at = (tmp_path / "run" / tune.FINDING_FILE).stat().st_mtime_ns
        again = run_cli(["trainer.resume=run", "trainer.progress_bar=off"], cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert line in again.stdout and (tmp_path / "run" / tune.FINDING_FILE).stat().st_mtime_ns == written_at
        assert "the finding recorded in" in again.stdout + again.stderr


def test_lr_find_draws_the_low_learning_rates_losses_as_measured_and_caps_only_the_divergence() -> None:
    from runner.tune.lr_find import LrCurve

    losses = [2.3, 2.3, 2.2, 1.5, 0.6, 0.33, 0.35, 0.9, 40.0, 5000.0]
    curve = LrCurve(lrs=[10 ** (-6 + i / 2) for i in range(len(losses))], losses=losses, smoothed=list(losses),
                    smoothing=0.0, diverge_factor=4.0)
    lrs, drawn = curve.finite()
    assert drawn[:6] == losses[:6]  # before: min(2.3, 4 x 0.33) = 1.32 for the first three points
    assert drawn[6:] == [0.35, 0.9, 1.32, 1.32]  # past the lowest loss, the blow-up is capped at 4 x its minimum
