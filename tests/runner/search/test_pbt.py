"""Population-based training (runner/search/pbt/): exploit copies the exact state, explore changes only the
keys it may and the new lr takes effect at once, a killed population resumes with the same members.

Populations of 2 digits MLPs, 6 optimizer steps in 2 rounds of 3, run in this process (the coordinator
with n_jobs=1 runs each member's round in-process); the CLI's refusals are in test_bad_input.py.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from runner.engine import checkpoint
from runner.search.pbt import explore
from runner.search.pbt.mutable import is_mutable
from runner.search.pbt.population import Population, Settings
from runner.specs.run import SpecError
from tests.conftest import compose_spec, run_cli

BASE = ["trainer.max_steps=6", "trainer.log_every_n_steps=1", "trainer.device=cpu", "trainer.eval_every_epoch=false",
        "trainer.memory_estimate=false", "trainer.limit_val=0.3", "trainer.limit_test=0.1", "dataset.batch_size=32"]
SPACE = {"optimizer.lr": "tag(log, interval(1e-3, 0.5))"}


def population(tmp_path: Path, store: str, settings: Settings, extra: list[str] = (), **kw) -> Population:
    base = compose_spec([*BASE, *extra], tmp_path / "base", store)
    return Population(base, explore.parse_space(SPACE), settings, tmp_path / "sweep", **kw)


def history(store: str, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in MlflowClient(store).get_metric_history(run_id, key)}


def copier_and_source(state: dict) -> tuple[dict, dict]:
    copier = next(m for m in state["members"] if m["lineage"])
    return copier, state["members"][copier["lineage"][0]["from"]]


def test_explore_changes_only_the_lr_and_it_takes_effect_at_that_step(tmp_path: Path, store: str) -> None:
    """Explore doubles the copied lr (factor 2) under a cosine schedule: the copier's logged lr at steps 4-6
    is twice its source's (the schedule's shape goes on), pbt/optimizer.lr is logged at step 3, and its
    spec differs from its source's only in optimizer.lr."""
    state = population(tmp_path, store, Settings(population=2, ready=3, quantile=0.5, perturb=(2.0,),
                                                 resample_probability=0.0), ["scheduler=cosine"]).run()
    copier, source = copier_and_source(state)
    assert copier["hparams"]["optimizer.lr"] == pytest.approx(2 * source["hparams"]["optimizer.lr"])
    own, theirs = history(store, copier["run_id"], "lr"), history(store, source["run_id"], "lr")
    for step in (4, 5, 6):
        assert own[step] == pytest.approx(2 * theirs[step], rel=1e-9)
    assert theirs[4] != theirs[6]  # the schedule moves
    assert history(store, copier["run_id"], "pbt/optimizer.lr")[3] == pytest.approx(copier["hparams"]["optimizer.lr"])
    specs = [yaml.safe_load((Path(m["run_dir"]) / "spec.yaml").read_text()) for m in (copier, source)]
    flat = [_flat(s) for s in specs]
    differ = {k for k in flat[0] if flat[0][k] != flat[1].get(k)}
    assert differ == {"optimizer.lr", "run_dir", "trainer.resume", "tracking.run_name"}


def test_explore_changes_the_lr_under_swa_lr_too(tmp_path: Path, store: str) -> None:
    """Defect 8: with trainer.swa.lr the schedule is SWA's (runner/addons/averaging.py), whose base schedule
    kept the old peak: the doubled lr held for the first step after the copy only (step 4), then the
    source's came back (step 5: 0.0475 where 0.0951 was asked). 2 steps an epoch, SWA from epoch 2 (step 6
    on): steps 4 and 5 take the base schedule's lr, doubled."""
    state = population(tmp_path, store, Settings(population=2, ready=3, quantile=0.5, perturb=(2.0,),
                                                 resample_probability=0.0),
                       ["scheduler=cosine", "trainer.limit_train=0.05", "trainer.swa.start_epoch=2",
                        "trainer.swa.lr=0.001"]).run()
    copier, source = copier_and_source(state)
    assert copier["hparams"]["optimizer.lr"] == pytest.approx(2 * source["hparams"]["optimizer.lr"])
    own, theirs = history(store, copier["run_id"], "lr"), history(store, source["run_id"], "lr")
    for step in (4, 5):
        assert own[step] == pytest.approx(2 * theirs[step], rel=1e-9)
    assert theirs[4] != theirs[5]  # the schedule moves


def test_explore_stays_within_bounds_and_refuses_keys_that_cannot_change_mid_run() -> None:
    space = explore.parse_space({"optimizer.lr": "tag(log, interval(1e-3, 0.1))", "model.dropout": "interval(0, 0.5)",
                                 "optimizer.momentum": "choice(0.8, 0.9, 0.99)"})
    rng = random.Random(0)
    values = {"optimizer.lr": 0.09, "model.dropout": 0.45, "optimizer.momentum": 0.99}
    for _ in range(50):
        values = explore.perturb(values, space, rng, (0.8, 1.2), 0.25)
        assert set(values) == set(space) and all(is_mutable(k) for k in values)
        assert 1e-3 <= values["optimizer.lr"] <= 0.1 and 0 <= values["model.dropout"] <= 0.5
        assert values["optimizer.momentum"] in (0.8, 0.9, 0.99)
    history = [(r, explore.sample(space, rng), rng.random()) for r in range(4) for _ in range(4)]
    proposal = explore.pb2_propose(space, history, 4, rng)
    assert 1e-3 <= proposal["optimizer.lr"] <= 0.1 and proposal["optimizer.momentum"] in (0.8, 0.9, 0.99)
    with pytest.raises(SpecError, match=r"^scheduler.warmup: interval\(0, 10\): population-based training changes only"):
        explore.parse_space({"scheduler.warmup": "interval(0, 10)"})


class Crash(Exception):
    pass


def test_a_killed_population_resumes_and_exploit_copies_the_exact_state(tmp_path: Path, store: str) -> None:
    """The coordinator dies after round 1 (its state saved, the bottom member's copy made); run again on the
    same sweep directory it trains round 2 only, with the same members and MLflow runs (no new one, each
    step logged once). The copier explored nothing (factor 1): from the copy at step 3 on it continues
    bitwise as its source: equal train/loss logged at steps 4-6 and equal final weights."""
    settings = Settings(population=2, ready=3, quantile=0.5, perturb=(1.0,), resample_probability=0.0)

    def crash(done: int) -> None:
        raise Crash(done)

    with pytest.raises(Crash):
        population(tmp_path, store, settings, on_round=crash).run()
    before = json.loads((tmp_path / "sweep" / "pbt_state.json").read_text())
    assert before["round"] == 1
    state = population(tmp_path, store, settings).run()
    assert state["round"] == 2 and [m["run_id"] for m in state["members"]] == [m["run_id"] for m in before["members"]]
    assert [m["hparams"] for m in state["members"]] == [m["hparams"] for m in before["members"]]
    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.info.run_id for r in runs) == sorted(m["run_id"] for m in state["members"])
    assert all(r.info.status == "FINISHED" for r in runs)

    copier, source = copier_and_source(state)
    assert copier["lineage"][0]["step"] == 3 and copier["run_id"] != source["run_id"]
    own, theirs = history(store, copier["run_id"], "train/loss"), history(store, source["run_id"], "train/loss")
    assert [m.step for m in client.get_metric_history(copier["run_id"], "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [m.step for m in client.get_metric_history(source["run_id"], "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [own[s] for s in (1, 2, 3)] != [theirs[s] for s in (1, 2, 3)]  # they differed before the copy
    assert [own[s] for s in (4, 5, 6)] == [theirs[s] for s in (4, 5, 6)]
    mine, source_weights = (checkpoint.load(Path(m["run_dir"])) for m in (copier, source))
    assert mine["progress"]["step"] == source_weights["progress"]["step"] == 6
    assert all(torch.equal(mine["model"][k], source_weights["model"][k]) for k in source_weights["model"])
    tags = client.get_run(copier["run_id"]).data.tags
    assert tags["pbt.copied_member"] == str(source["id"]) and tags["pbt.copied_at_step"] == "3"


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.slow  # ~40 s; test_a_killed_population_resumes_and_exploit_copies_the_exact_state keeps the resume in CI
def test_a_sigkilled_population_command_goes_on_from_its_last_round_when_run_again(tmp_path: Path) -> None:
    """A real SIGKILL of the whole sweep (coordinator and member) during round 2 of 3; the same command on the
    same sweep directory finishes rounds 2 and 3 with the same members and MLflow runs, each step's
    train/loss logged once, and every run ends FINISHED."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import sqlite3

    def in_round_2(db: Path) -> bool:  # a member has logged a step of round 2 (steps 11-20)
        try:
            with sqlite3.connect(db, timeout=1) as con:
                (top,) = con.execute("select max(step) from metrics where key = 'train/loss'").fetchone()
            return (top or 0) > 11
        except sqlite3.Error:
            return False

    sweep, db = tmp_path / "sweep", tmp_path / "mlflow.db"
    cmd = [sys.executable, "-m", "runner", "-m", "hparams_search=digits_pbt", "trainer.max_steps=30",
           "hydra.sweeper.ready=10", "hydra.sweeper.population=2", "hydra.sweeper.quantile=0.5",
           "trainer.log_every_n_steps=1", "trainer.progress_bar=off", "trainer.memory_estimate=false",
           f"hydra.sweep.dir={sweep}", f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={tmp_path / 'art'}"]
    first = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    state_file, deadline = sweep / "pbt_state.json", time.time() + 300
    try:
        while time.time() < deadline and first.poll() is None and not in_round_2(db):
            time.sleep(0.02)
        assert first.poll() is None, first.communicate()[0][-3000:]
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    before = json.loads(state_file.read_text())
    assert before["round"] == 1
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    state = json.loads(state_file.read_text())
    assert state["round"] == 3 and [m["run_id"] for m in state["members"]] == [m["run_id"] for m in before["members"]]
    client = MlflowClient(f"sqlite:///{db}")
    for member in state["members"]:
        steps = [m.step for m in client.get_metric_history(member["run_id"], "train/loss")]
        assert steps == list(range(1, 31)), (member["id"], steps)
        assert client.get_run(member["run_id"]).data.tags.get("mlflow.parentRunId")
    members = {m["run_id"] for m in state["members"]}
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert {r.info.status for r in runs if r.info.run_id in members} == {"FINISHED"}


def test_lr_multiplier_globs_with_a_dot_are_explored_as_one_key(tmp_path: Path, store: str) -> None:
    """`optimizer.lr_multipliers.1.*` (README's `backbone.*` has a dot too; issue 22, defect 15) parses as a
    space, and each member trains with {"1.*": its value}: the glob stays one key of lr_multipliers, and the
    first layer's group logs lr x that value at every step of both rounds."""
    base = compose_spec(BASE, tmp_path / "base", store)
    space = explore.parse_space({"optimizer.lr_multipliers.1.*": "interval(0.1, 0.9)"})
    assert space == {"optimizer.lr_multipliers.1.*": explore.Dim(0.1, 0.9)}
    settings = Settings(population=2, ready=3, quantile=0.5, perturb=(0.5,), resample_probability=0.0)
    state = Population(base, space, settings, tmp_path / "sweep").run()
    copier, _ = copier_and_source(state)
    for member in state["members"]:
        multiplier = member["hparams"]["optimizer.lr_multipliers.1.*"]
        spec = yaml.safe_load((Path(member["run_dir"]) / "spec.yaml").read_text())
        assert spec["optimizer"]["lr_multipliers"] == {"1.*": multiplier}
        lr, scaled = history(store, member["run_id"], "lr"), history(store, member["run_id"], f"lr/x{multiplier:g}")
        steps = (4, 5, 6) if member is copier else (1, 2, 3, 4, 5, 6)
        assert [scaled[s] for s in steps] == [pytest.approx(lr[s] * multiplier, rel=1e-4) for s in steps]


def test_a_diverging_member_ranks_last_and_is_exploited(tmp_path: Path, store: str) -> None:
    """Member 1's lr (1000) makes it diverge at step 2 of round 1 (issue 22, defect 9): the population goes on,
    the member ranks last with a NaN objective, copies member 0's step-3 checkpoint with its lr doubled, and
    trains round 2 to the end; both MLflow runs end FINISHED, the diverged round's failure recorded as a tag."""
    base = compose_spec([*BASE, "model._target_=tests.user_pkg.nan_net.NanWhenLarge", "optimizer=sgd"],
                        tmp_path / "base", store)
    settings = Settings(population=2, ready=3, quantile=0.5, perturb=(2.0,), resample_probability=0.0)
    pop = Population(base, explore.parse_space(SPACE), settings, tmp_path / "sweep")
    start = pop.load_or_start()
    for member, lr in zip(start["members"], (0.01, 1000.0)):
        member["hparams"]["optimizer.lr"] = lr
    pop._save(start)
    state = pop.run()
    good, diverged = state["members"]
    assert math.isfinite(good["objectives"][0][1]) and diverged["lineage"] == [{"from": 0, "step": 3, "run": good["run_id"]}]
    assert diverged["hparams"]["optimizer.lr"] == pytest.approx(0.02)
    client = MlflowClient(store)
    assert [m.step for m in client.get_metric_history(diverged["run_id"], "val/acc")][-1] == 6
    assert [client.get_run(m["run_id"]).info.status for m in (good, diverged)] == ["FINISHED", "FINISHED"]
    assert client.get_run(diverged["run_id"]).data.tags["pbt.diverged"].startswith("the loss is not finite from step 2 on")
    assert history(store, diverged["run_id"], "pbt/optimizer.lr") == {0: 1000.0, 3: pytest.approx(0.02)}


def test_a_population_whose_every_member_diverged_stops_in_one_line(tmp_path: Path, store: str) -> None:
    base = compose_spec([*BASE, "model._target_=tests.user_pkg.nan_net.NanWhenLarge", "optimizer=sgd"],
                        tmp_path / "base", store)
    pop = Population(base, explore.parse_space(SPACE), Settings(population=2, ready=3, quantile=0.5), tmp_path / "sweep")
    start = pop.load_or_start()
    for member in start["members"]:
        member["hparams"]["optimizer.lr"] = 1000.0
    pop._save(start)
    with pytest.raises(SpecError, match=r"^hydra.sweeper.params: every member diverged by step 3 \(a NaN val/acc\); "
                                        r"narrow the space toward smaller lrs, or clip gradients$"):
        pop.run()


# --- signals to a sweep whose members train in their own processes (n_jobs=2), as a user's kill sends them

def _pbt_command(tmp_path: Path, *extra: str) -> list[str]:
    return ["hparams_search=digits_pbt", "hydra.sweeper.population=2", "hydra.sweeper.quantile=0.5",
            "trainer.log_every_n_steps=1", "trainer.progress_bar=off", "trainer.memory_estimate=false",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"tracking.artifact_root={tmp_path / 'art'}", *extra]


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (Linux's /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _runs_by_name(db: Path) -> dict[str, str]:
    import sqlite3

    with sqlite3.connect(db, timeout=5) as con:
        return dict(con.execute("select name, status from runs"))


def _start_sweep_and_wait_for_training_members(tmp_path: Path):
    import sqlite3
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "runner", "-m", *_pbt_command(tmp_path, "trainer.max_steps=4000",
                                                                 "hydra.sweeper.ready=2000", "hydra.sweeper.n_jobs=2")]
    sweep = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and sweep.poll() is None:  # both members have logged a step of training
        try:
            with sqlite3.connect(tmp_path / "mlflow.db", timeout=1) as con:
                (training,) = con.execute("select count(distinct run_uuid) from metrics where key = 'train/loss'").fetchone()
        except sqlite3.Error:
            training = 0
        if training == 2:
            break
        time.sleep(0.1)
    assert sweep.poll() is None, sweep.communicate()[1][-3000:]
    members = _children(sweep.pid)
    assert len(members) == 2
    return sweep, members


def _gone_within(pids: set[int], seconds: float) -> bool:
    import time

    deadline = time.time() + seconds
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


@pytest.mark.slow  # two member processes: ~40 s
def test_pbt_members_stop_when_their_sweep_is_sigkilled(tmp_path: Path) -> None:
    """A SIGKILL of the sweep process alone (not its group): its n_jobs=2 members notice within a second, stop
    at a step boundary with their checkpoint, and end their MLflow runs KILLED, never left RUNNING."""
    import os
    import signal

    sweep, members = _start_sweep_and_wait_for_training_members(tmp_path)
    try:
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait()
        assert _gone_within(members, 15)
    finally:
        for pid in members:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    statuses = _runs_by_name(tmp_path / "mlflow.db")
    assert [statuses[f"pbt member {i}"] for i in (0, 1)] == ["KILLED", "KILLED"]
    for i in (0, 1):
        assert list((tmp_path / "sweep" / f"member-{i}" / "checkpoints").glob("step-*")), f"member {i}: no checkpoint"


@pytest.mark.slow  # two member processes: ~40 s
def test_a_sigtermed_pbt_sweep_stops_its_members_and_ends_killed_in_one_line(tmp_path: Path) -> None:
    """SIGTERM to the sweep process alone while its members train: it stops them, marks its parent run and
    theirs KILLED, says so in one line and exits 143 (128 + SIGTERM), no traceback."""
    import os
    import signal

    sweep, members = _start_sweep_and_wait_for_training_members(tmp_path)
    try:
        os.kill(sweep.pid, signal.SIGTERM)
        _, err = sweep.communicate(timeout=120)
        assert _gone_within(members, 15)
    finally:
        for pid in (sweep.pid, *members):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert sweep.returncode == 143, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == \
        "runner: stopped by SIGTERM; the run was marked KILLED"
    statuses = _runs_by_name(tmp_path / "mlflow.db")
    assert [statuses[f"pbt member {i}"] for i in (0, 1)] == ["KILLED", "KILLED"]
    assert [s for name, s in statuses.items() if name.startswith("pbt ") and "member" not in name] == ["KILLED"]


@pytest.mark.slow  # ~40 s
def test_a_sigterm_between_rounds_ends_the_sweep_killed_in_one_line(tmp_path: Path) -> None:
    """SIGTERM while the sweep ranks its members (no member training, n_jobs=2): one line, exit 143, the parent
    KILLED (not RUNNING), the members' runs paused at the boundary as every round leaves them."""
    import subprocess
    import sys

    killed = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "kill_at.py"), "pbt_exploit:TERM", "1",
                             "-m", *_pbt_command(tmp_path, "trainer.max_steps=4", "hydra.sweeper.ready=2",
                                                 "hydra.sweeper.n_jobs=2")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 143, killed.stderr[-3000:]
    assert "Traceback" not in killed.stderr
    assert killed.stderr.strip().splitlines()[-1] == "runner: stopped by SIGTERM; the run was marked KILLED"
    statuses = _runs_by_name(tmp_path / "mlflow.db")
    assert "RUNNING" not in statuses.values()
    assert [s for name, s in statuses.items() if name.startswith("pbt ") and "member" not in name] == ["KILLED"]


@pytest.mark.slow  # a SIGTERM and a rerun: ~40 s
def test_after_a_sigterm_mid_member_its_explored_values_are_logged_at_the_rounds_start(tmp_path: Path) -> None:
    """SIGTERM in member 0's 3rd step of round 2 (steps 11-20; it copied member 1 at step 10): the member writes a
    step-13 checkpoint and the rerun resumes from it; its pbt/optimizer.lr is still logged at step 10, where its
    explored values took over, not at 13 where the rerun began."""
    import subprocess
    import sys

    args = _pbt_command(tmp_path, "trainer.max_steps=20", "hydra.sweeper.ready=10", "hydra.sweeper.n_jobs=1")
    # train steps in the sweep's process: member 0's 1-10, member 1's 1-10, member 0's 11-20, ...
    killed = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "kill_at.py"), "step:TERM", "23", "-m",
                             *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert killed.returncode == 143, killed.stderr[-3000:]
    assert list((tmp_path / "sweep" / "member-0" / "checkpoints").glob("step-*13*"))
    again = run_cli(["-m", *args], cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    state = json.loads((tmp_path / "sweep" / "pbt_state.json").read_text())
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    copier, source = copier_and_source(state)
    assert copier["id"] == 0
    assert set(history(store, copier["run_id"], "pbt/optimizer.lr")) == {0, 10}
    assert set(history(store, source["run_id"], "pbt/optimizer.lr")) == {0}


@pytest.mark.slow  # a population of 2 from the command line: ~30 s
def test_a_pbt_commands_console_shows_each_line_once_without_hydras_stamps_and_the_ui_once(tmp_path: Path) -> None:
    """Members train in the sweep's process, whose logging is Hydra's (each line stamped `[time][HYDRA]`): their
    lines and PBT's rounds read as a job's do, and how to open the MLflow UI is said once, by the parent."""
    proc = run_cli(["-m", *_pbt_command(tmp_path, "trainer.max_steps=6", "hydra.sweeper.ready=3")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert sum("PBT round" in ln for ln in lines) == 2 and sum(ln.startswith("epoch ") for ln in lines) > 0
    assert not [ln for ln in lines if "][HYDRA]" in ln and ("PBT" in ln or "epoch " in ln or "val/" in ln)], lines
    assert sum("mlflow_ui --backend-store-uri" in ln for ln in lines) == 1, lines
