"""runner/engine/schedule.py: exact lr shapes, warmup composition, plateau, validation, checkpoints."""
from __future__ import annotations

import inspect
import io
import math

import pytest
import torch
import yaml
from pytest import approx

from runner.specs import registry
from runner.specs.components import load_target
from runner.engine.monitor import learning_rates
from runner.engine.schedule import NO_WARMUP, Schedule, build_scheduler
from runner.specs.run import SpecError
from runner.specs.scheduler import SchedulerSpec

NAMES = registry.options("scheduler")


def spec_of(name: str, **changes) -> SchedulerSpec:
    """The spec conf/scheduler/<name>.yaml composes to, with changes."""
    data = yaml.safe_load((registry.CONF_DIR / "scheduler" / f"{name}.yaml").read_text())
    return SchedulerSpec.parse({**data, **changes})


def sgd(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def base_lr(schedule: Schedule) -> float:
    """The lr the run logs as `lr` (the base rate, as the optimizer's groups hold it now)."""
    return learning_rates(schedule.optimizer)["lr"]


def lrs(spec: SchedulerSpec, total: int, lr: float = 1.0, steps: int | None = None) -> list[float]:
    """lrs[k]: the lr optimizer step k runs with (lrs[total]: after the last step)."""
    optimizer = sgd(lr)
    schedule = build_scheduler(spec, optimizer, total)
    out = [base_lr(schedule)]
    for _ in range(total if steps is None else steps):
        optimizer.step()  # no gradients: a no-op that keeps torch's step-order check quiet
        schedule.step()
        out.append(base_lr(schedule))
    return out


def test_the_options_are_the_documented_eleven():
    assert set(NAMES) == {"constant", "step", "multistep", "exponential", "cosine", "warmup_cosine", "onecycle",
                          "cyclic", "sgdr", "plateau", "wsd"}


@pytest.mark.parametrize("name", NAMES)
def test_yaml_names_its_schedule_and_only_keys_it_takes(name):
    path = registry.CONF_DIR / "scheduler" / f"{name}.yaml"
    assert path.read_text().startswith("# "), "each option starts with a one-line comment saying what it is"
    data = yaml.safe_load(path.read_text())
    spec = SchedulerSpec.parse(data)
    assert set(spec.params) <= set(inspect.signature(load_target("scheduler", spec.target)).parameters)
    assert all(0 < lr <= 1.0 for lr in lrs(spec, 200)[:-1])  # the peak is the optimizer's lr


def test_constant_stays_constant():
    assert lrs(spec_of("constant"), 10, lr=0.3) == [0.3] * 11


def test_constant_with_warmup_ramps_linearly_then_holds():
    assert lrs(spec_of("constant", warmup=4), 8) == approx([0.2, 0.4, 0.6, 0.8, 1, 1, 1, 1, 1])


def test_warmup_cosine():
    got = lrs(spec_of("warmup_cosine", warmup=10, min_lr_ratio=0.1), 100, lr=2.0)
    assert got[0] == approx(2.0 / 11)  # linear from peak/(warmup+1)
    assert got[9] == approx(2.0 * 10 / 11)
    assert got[10] == approx(2.0)  # step `warmup` is the first at the peak
    assert got[55] == approx(0.2 + 1.8 * 0.5)  # half way through the cosine
    assert got[100] == approx(0.2)  # min_lr_ratio * peak
    assert all(a > b for a, b in zip(got[10:], got[11:]))


def test_warmup_as_a_fraction_of_the_run():
    assert lrs(spec_of("warmup_cosine", warmup=0.1), 100) == approx(lrs(spec_of("warmup_cosine", warmup=10), 100))


def test_cosine_ends_at_min_lr_and_holds_past_the_end():
    got = lrs(spec_of("cosine", min_lr_ratio=0.05), 20, steps=25)
    assert got[0] == 1.0 and got[10] == approx(0.525) and got[20:] == approx([0.05] * 6)


def test_step_decays_every_step_size_after_warmup():
    got = lrs(spec_of("step", step_size=5, gamma=0.5, warmup=2), 20)
    assert got[2:7] == approx([1.0] * 5) and got[7] == approx(0.5) and got[12] == approx(0.25)


def test_multistep_milestones_count_from_the_start():
    got = lrs(spec_of("multistep", milestones=(0.5, 75), gamma=0.1, warmup=10), 100)
    assert got[49] == approx(1.0) and got[50] == approx(0.1)
    assert got[74] == approx(0.1) and got[75] == approx(0.01) and got[100] == approx(0.01)


def test_exponential_falls_by_gamma_every_step_size():
    got = lrs(spec_of("exponential", step_size=10, gamma=0.5), 20)
    assert got[5] == approx(math.sqrt(0.5)) and got[10] == approx(0.5) and got[20] == approx(0.25)


def test_wsd_holds_the_peak_then_decays_linearly():
    got = lrs(spec_of("wsd", warmup=10, decay=0.2, min_lr_ratio=0.1), 100)
    assert got[0] == approx(1 / 11)
    assert got[10:81] == approx([1.0] * 71)
    assert got[90] == approx(0.55) and got[100] == approx(0.1)


def test_sgdr_restarts():
    got = lrs(spec_of("sgdr", cycle_steps=10, cycle_mult=2), 40)
    assert got[0] == 1.0 and got[5] == approx(0.5) and got[9] < 0.03
    assert got[10] == approx(1.0) and got[20] == approx(0.5) and got[30] == approx(1.0)


def test_onecycle_peaks_at_pct_start():
    got = lrs(spec_of("onecycle", pct_start=0.3, base_lr_ratio=0.04), 99, lr=0.5)
    assert got[0] == approx(0.02)
    assert max(got) == approx(0.5) and got.index(max(got)) == 29
    assert got[99] == approx(0.02 / 1e4)  # torch's final_div_factor


def test_cyclic_triangle():
    got = lrs(spec_of("cyclic", cycle_steps=8, base_lr_ratio=0.1), 16)
    assert got[0] == approx(0.1) and got[2] == approx(0.55) and got[4] == approx(1.0) and got[8] == approx(0.1)


def test_plateau_decays_once_patience_is_exceeded():
    optimizer = sgd(1.0)
    schedule = build_scheduler(spec_of("plateau", patience=2, factor=0.5), optimizer, 100)
    schedule.step()  # only evaluations move it
    seen = []
    for loss in (1.0, 0.9, 0.95, 0.91, 0.92, 0.93, 0.94):  # best 0.9, then non-improving evaluations
        schedule.on_eval({"val/loss": loss, "val/acc": 0.5})
        seen.append(base_lr(schedule))
    assert seen == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5]


def test_plateau_mode_max_and_a_missing_metric():
    schedule = build_scheduler(spec_of("plateau", patience=0, monitor="val/acc", mode="max"), sgd(), 10)
    schedule.on_eval({"val/acc": 0.5})
    schedule.on_eval({"val/acc": 0.6})
    assert base_lr(schedule) == 1.0
    schedule.on_eval({"val/acc": 0.6})
    assert base_lr(schedule) == 0.5
    with pytest.raises(SpecError, match=r"^scheduler\.monitor: 'val/acc' is not among .* val/loss"):
        schedule.on_eval({"val/loss": 1.0})


def test_the_schedule_scales_every_group():
    p, q = (torch.nn.Parameter(torch.zeros(1)) for _ in range(2))
    optimizer = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.1}], lr=1.0)
    schedule = build_scheduler(spec_of("onecycle"), optimizer, 10)
    assert [g["lr"] for g in optimizer.param_groups] == approx([0.04, 0.004])
    assert isinstance(schedule, Schedule)


def group_lrs(spec: SchedulerSpec, total: int) -> list[list[float]]:
    """Per step, the lr of two groups whose peaks differ tenfold (optimizer.lr_multipliers)."""
    p, q = (torch.nn.Parameter(torch.zeros(1)) for _ in range(2))
    optimizer = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr": 0.1}], lr=1.0)
    schedule = build_scheduler(spec, optimizer, total)
    out = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(total):
        optimizer.step()
        schedule.step()
        out.append([g["lr"] for g in optimizer.param_groups])
    return out


@pytest.mark.parametrize("spec", [dict(name="cosine"), dict(name="warmup_cosine", warmup=5),
                                  dict(name="sgdr", cycle_steps=10, cycle_mult=2), dict(name="sgdr", cycle_steps=8)])
def test_a_floor_is_a_fraction_of_each_groups_own_peak(spec):
    """With lr_multipliers the groups peak at different lrs; each one's curve is the one-group curve scaled."""
    spec = spec_of(spec.pop("name"), min_lr_ratio=0.1, **spec)
    one = lrs(spec, 40)
    both = group_lrs(spec, 40)
    assert [a for a, _ in both] == approx(one, abs=1e-12)
    assert [b for _, b in both] == approx([0.1 * x for x in one], abs=1e-12)
    assert 0.01 - 1e-12 <= min(b for _, b in both) < 0.015  # the floor: 0.1 x 0.1, not 0.1 x 1.0
    if spec.target.endswith("cosine") and not spec.warmup:
        assert both[40] == approx([0.1, 0.01])


@pytest.mark.parametrize("total", range(1, 8))
def test_onecycle_runs_of_a_few_steps_ramp_and_anneal(total):
    """torch's OneCycleLR divides by zero when pct_start x steps is one; a short run still gets its cycle."""
    got = lrs(spec_of("onecycle", pct_start=0.25, base_lr_ratio=0.04), total)
    assert got[0] == approx(0.04) and got[-1] == approx(0.04 / 1e4)
    assert all(0 < x <= 1.0 for x in got[:-1]) and (total == 1 or max(got) > 0.04)


@pytest.mark.parametrize("spec, key", [
    (dict(name="cosine", warmup=100), r"scheduler\.warmup: 100 \(100 steps\) .* shorter than the run's 100"),
    (dict(name="cosine", warmup=0.999), r"scheduler\.warmup: 0\.999 \(100 steps\)"),
    (dict(name="cosine", warmup=2.5), r"scheduler\.warmup: 2\.5 is not allowed; give whole optimizer steps"),
    (dict(name="onecycle", warmup=5), r"scheduler\.warmup: 5 is not allowed with onecycle"),
    (dict(name="plateau", warmup=0.1), r"scheduler\.warmup: 0\.1 is not allowed with ReduceLROnPlateau"),
    (dict(name="wsd", warmup=50, decay=60), r"scheduler\.decay: 60 \(60 steps\) .* fit in the run's 100"),
    (dict(name="multistep", warmup=10, milestones=(5, 50)), r"scheduler\.milestones: 5 \(5 steps\)"),
    (dict(name="multistep", milestones=(50, 100)), r"scheduler\.milestones: 100 .* before the end \(100 steps\)"),
    (dict(name="sgdr", cycle_mult=1.5), r"scheduler\.cycle_mult: 1\.5 is not allowed; give a whole number"),
    (dict(name="cyclic", cycle_steps=0.01), r"scheduler\.cycle_steps: 0\.01 resolves to 1 steps; allowed: at least 2"),
])
def test_impossible_combinations_are_spec_errors(spec, key):
    with pytest.raises(SpecError, match="^" + key):
        build_scheduler(spec_of(spec.pop("name"), **spec), sgd(), 100)


def round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # how checkpoints are read back


def takes_warmup(name: str) -> bool:
    return load_target("scheduler", spec_of(name).target) not in NO_WARMUP and name != "plateau"


@pytest.mark.parametrize("name, warmup", [(n, w) for n in NAMES for w in (0, 5) if not w or takes_warmup(n)])
def test_state_dict_round_trips_and_resumes_exactly(name, warmup):
    spec = spec_of(name, warmup=warmup, **({"patience": 1} if name == "plateau" else {}))
    metrics = [{"val/loss": 1.0 - 0.01 * (i % 3)} for i in range(12)]

    def run(optimizer: torch.optim.Optimizer, schedule: Schedule, steps: range) -> list[float]:
        out = []
        for i in steps:
            optimizer.step()
            schedule.step()
            if i % 4 == 3:
                schedule.on_eval(metrics[i // 4])
            out.append(base_lr(schedule))
        return out

    optimizer = sgd()
    schedule = build_scheduler(spec, optimizer, 40)
    run(optimizer, schedule, range(20))
    saved = round_trip({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()})
    resumed_optimizer = sgd()
    resumed = build_scheduler(spec, resumed_optimizer, 40)  # built first, then loaded: the engine's order
    resumed_optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["schedule"])
    assert base_lr(resumed) == base_lr(schedule)
    assert run(resumed_optimizer, resumed, range(20, 45)) == run(optimizer, schedule, range(20, 45))


# --- extending a run: a larger max_steps continues the schedule rebuilt for the new length -------------------

EXTEND = {"step": dict(step_size=10), "exponential": dict(step_size=10), "multistep": dict(milestones=[0.4, 0.8]),
          "sgdr": dict(cycle_steps=0.2), "cyclic": dict(cycle_steps=0.2)}


@pytest.mark.parametrize("name", [n for n in NAMES if n != "plateau"])
def test_extending_a_finished_run_continues_the_schedule_planned_for_the_new_length(name):
    """A finished 30-step run resumed with 60 steps: from step 30 on, its lr is that of a run planned for 60
    steps from the start (for cosine: half the peak, falling; it never climbs back to the peak)."""
    spec = spec_of(name, **EXTEND.get(name, {}), **({"warmup": 3} if takes_warmup(name) else {}))
    optimizer = sgd()
    short = build_scheduler(spec, optimizer, 30)
    for _ in range(30):
        optimizer.step()
        short.step()
    saved = round_trip({"optimizer": optimizer.state_dict(), "schedule": short.state_dict()})
    resumed_optimizer = sgd()
    extended = build_scheduler(spec, resumed_optimizer, 60)  # the engine's order: built for the new length, then loaded
    resumed_optimizer.load_state_dict(saved["optimizer"])
    extended.load_state_dict(saved["schedule"])
    got = [base_lr(extended)]
    for _ in range(30):
        resumed_optimizer.step()
        extended.step()
        got.append(base_lr(extended))
    planned = lrs(spec, 60)
    assert got == approx(planned[30:], rel=1e-12, abs=1e-15)
    if name in ("cosine", "warmup_cosine"):
        assert 0.45 < got[0] < 0.6 and all(a > b for a, b in zip(got[:-1], got[1:]))


def test_extending_a_plateau_run_keeps_its_reductions():
    optimizer = sgd()
    schedule = build_scheduler(spec_of("plateau", patience=0), optimizer, 30)
    for loss in (1.0, 1.0, 1.0):  # two evaluations without improvement: two halvings
        schedule.on_eval({"val/loss": loss})
    saved = round_trip({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()})
    resumed_optimizer = sgd()
    extended = build_scheduler(spec_of("plateau", patience=0), resumed_optimizer, 60)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    extended.load_state_dict(saved["schedule"])
    assert base_lr(extended) == 0.25
    extended.on_eval({"val/loss": 1.0})
    assert base_lr(extended) == 0.125  # the best so far (1.0) came with the state


@pytest.mark.usefixtures("store")  # its tmp_path/mlflow.db comes migrated (tests/conftest.py): seconds saved
def test_a_cosine_run_extended_from_10_to_20_steps_logs_the_rebuilt_schedule(tmp_path):
    """Through the CLI's launch, in place, logging to MLflow: the lr of steps 11..20 is the 20-step cosine's."""
    from runner.cli.launch import run
    from tests.conftest import compose_spec
    from tests.runner.engine.test_parallel import metric_history

    uri, run_dir = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "run"
    common = ["scheduler=cosine", "optimizer=sgd", "optimizer.lr=0.1", "trainer.log_every_n_steps=1",
              "trainer.eval_every_epoch=false", "trainer.progress_bar=off", "dataset.batch_size=16"]
    run(compose_spec([*common, "trainer.max_steps=10"], run_dir, tracking_uri=uri))
    run(compose_spec([*common, "trainer.max_steps=20", f"trainer.resume={run_dir}"], tmp_path / "again", tracking_uri=uri))
    logged = dict(metric_history(tmp_path / "mlflow.db")["lr"])
    assert sorted(logged) == list(range(1, 21))  # one MLflow run, continued in place
    # the lr the step used or the one after it (which one the engine logs is the step loop's business): both
    # follow the 60-step curve from step 31 on, never back up to the peak
    planned = {k: 0.05 * (1 + math.cos(math.pi * k / 20)) for k in range(21)}
    tail = [logged[k] for k in range(11, 21)]
    assert tail in ([approx(planned[k - 1]) for k in range(11, 21)], [approx(planned[k]) for k in range(11, 21)])
    assert max(tail) <= 0.0501 and all(a > b for a, b in zip(tail[:-1], tail[1:]))  # half the peak at most, falling


def test_a_constant_schedule_that_skips_torchs_step_keeps_its_lrs_and_state_as_torchs_own_steps() -> None:
    """After its warmup `constant` only moves torch's counters (its step would rewrite the same lrs): every
    lr and the state a checkpoint holds equal those of a schedule that runs torch's step each time; a peak
    changed mid-run (PBT's scale_peak) still reaches the groups at the next step."""
    spec = spec_of("constant", warmup=3)
    fast_opt, slow_opt = sgd(0.5), sgd(0.5)
    fast, slow = build_scheduler(spec, fast_opt, 20), build_scheduler(spec, slow_opt, 20)
    slow.constant_from = None  # torch's step every time
    for step in range(20):
        if step == 12:
            for schedule in (fast, slow):
                schedule.optimizer.param_groups[0]["lr"] *= 0.1
                schedule.scale_peak(0, 0.1)
        for optimizer, schedule in ((fast_opt, fast), (slow_opt, slow)):
            optimizer.step()
            schedule.step()
        assert base_lr(fast) == base_lr(slow), step
        assert fast.state_dict() == slow.state_dict(), step
    assert base_lr(fast) == 0.05


def test_a_held_constant_schedule_checks_every_group_as_torchs_step_would() -> None:
    """The held constant schedule checks every group: a second group's lr set by hand is put back to its peak as by
    torch's step, lrs and state equal torch's own; a group added mid-run fails the step as torch's does."""
    spec = spec_of("constant")

    def two_groups() -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]},
                                {"params": [torch.zeros(1, requires_grad=True)], "lr": 0.25}], lr=0.5)

    fast_opt, slow_opt = two_groups(), two_groups()
    fast, slow = build_scheduler(spec, fast_opt, 20), build_scheduler(spec, slow_opt, 20)
    slow.constant_from = None  # torch's step every time
    for step in range(12):
        for optimizer, schedule in ((fast_opt, fast), (slow_opt, slow)):
            if step == 8:
                optimizer.param_groups[1]["lr"] = 0.125
            optimizer.step()
            schedule.step()
        assert [g["lr"] for g in fast_opt.param_groups] == [g["lr"] for g in slow_opt.param_groups], step
        assert fast.state_dict() == slow.state_dict(), step
    assert [g["lr"] for g in fast_opt.param_groups] == [0.5, 0.25]
    for optimizer, schedule in ((fast_opt, fast), (slow_opt, slow)):
        optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "lr": 0.1})
        with pytest.raises(ValueError, match="zip"):
            schedule.step()
