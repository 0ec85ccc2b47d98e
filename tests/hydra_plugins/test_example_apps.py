"""The sweeper's documented configuration surface, on this project's own example apps
(tests/hydra_plugins/apps): samplers, the search-space grammar (choice, range, interval, int(...),
tag(log, ...)), a search space completed by a function, several objectives, and the results file."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from runner.search.trial import open_storage

APPS = Path(__file__).parent / "apps"


def load(app: str):
    spec = importlib.util.spec_from_file_location(app, APPS / app / f"{app}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(cwd: Path, app: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(APPS / app / f"{app}.py"), "-m", f"hydra.sweep.dir={cwd}/sweep", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def study(cwd: Path, name: str) -> optuna.Study:
    """`storage: null` keeps the study in the sweep directory."""
    return optuna.load_study(study_name=name, storage=open_storage(str(cwd / "sweep" / "optuna.journal")))


def results(cwd: Path) -> dict:
    return yaml.safe_load((cwd / "sweep" / "optimization_results.yaml").read_text())


def test_a_mixed_search_space_is_sampled_within_its_bounds_and_the_best_is_reported(tmp_path: Path) -> None:
    sweep(tmp_path, "kiln")
    s = study(tmp_path, "kiln")
    trials = s.trials
    assert len(trials) == 8 and all(t.state == TrialState.COMPLETE for t in trials)
    assert trials[0].distributions == {
        "peak": IntDistribution(1160, 1280, step=20),          # range(): the stop (1280) is a value
        "hold": CategoricalDistribution([5, 20, 45]),
        "ramp": FloatDistribution(0.01, 10, log=True),          # tag(log, interval(...))
        "glaze": CategoricalDistribution(["clear", "celadon", "tenmoku"])}
    defects = load("kiln").defects
    for t in trials:
        assert t.value == pytest.approx(defects(**t.params))  # each job ran with its trial's parameters
    best = results(tmp_path)
    assert best["name"] == "optuna" and best["study_name"] == "kiln" and best["trials"] == {"COMPLETE": 8}
    assert best["best_value"] == min(t.value for t in trials) and best["best_params"] == s.best_trial.params


def test_the_grid_sampler_visits_every_point_of_a_command_line_space_once(tmp_path: Path) -> None:
    sweep(tmp_path, "kiln", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=50",
          "peak=range(1200, 1240, step=20)", "ramp=0.1", "glaze=clear")
    trials = study(tmp_path, "kiln").trials
    points = sorted((t.params["peak"], t.params["hold"]) for t in trials)
    assert points == sorted((p, h) for p in (1200, 1220, 1240) for h in (5, 20, 45))  # n_trials capped at the grid's 9
    assert results(tmp_path)["best_value"] == pytest.approx(load("kiln").defects(1220, 20, 0.1, "clear"))


def test_random_sampling_of_an_integer_interval_in_two_slots(tmp_path: Path) -> None:
    sweep(tmp_path, "kiln", "hydra/sweeper/sampler=random", "hydra.sweeper.n_jobs=2", "hold=int(interval(1, 60))")
    trials = study(tmp_path, "kiln").trials
    assert len(trials) == 8 and all(t.state == TrialState.COMPLETE for t in trials)
    assert all(isinstance(t.params["hold"], int) and 1 <= t.params["hold"] <= 60 for t in trials)
    assert trials[0].distributions["hold"] == IntDistribution(1, 60)


def test_a_custom_search_space_function_adds_parameters_that_depend_on_the_sampled_ones(tmp_path: Path) -> None:
    sweep(tmp_path, "orchard")
    s = study(tmp_path, "orchard")
    assert s.direction == optuna.study.StudyDirection.MAXIMIZE and len(s.trials) == 6
    harvest = load("orchard").harvest
    for t in s.trials:
        p = t.params
        assert 2 <= p["rows"] <= 6 and 1 <= p["passes"] <= p["rows"] and 0 <= p["+thinning"] <= 0.6
        assert t.value == pytest.approx(harvest(p["rows"], p["spacing"], p["passes"], p["+thinning"]))
    assert results(tmp_path)["best_value"] == max(t.value for t in s.trials)


def test_two_objectives_report_their_pareto_front(tmp_path: Path) -> None:
    sweep(tmp_path, "bridge")
    s = study(tmp_path, "bridge")
    assert [d.name for d in s.directions] == ["MINIMIZE", "MINIMIZE"] and isinstance(s.sampler, optuna.samplers.BaseSampler)
    mass_and_sag = load("bridge").mass_and_sag
    for t in s.trials:
        assert t.values == pytest.approx(list(mass_and_sag(**t.params)))
        assert 0.2 <= t.params["depth"] <= 1.0 + 1e-9
    front = results(tmp_path)["solutions"]
    assert {f["trial"] for f in front} == {t.number for t in s.best_trials}
    for f in front:  # nothing the study found is better on both objectives
        assert not any(t.values[0] < f["values"][0] and t.values[1] < f["values"][1] for t in s.trials)


def test_the_removed_motpe_sampler_gets_one_line_naming_what_to_use(tmp_path: Path) -> None:
    proc = sweep(tmp_path, "kiln", "hydra/sweeper/sampler=motpe", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [  # hydra-optuna-sweeper's test: "motpe", "sampler was removed in Optuna 4.0"
        "error: hydra/sweeper/sampler: the 'motpe' sampler was removed in Optuna 4.0; use "
        "hydra/sweeper/sampler=tpe (TPESampler handles several objectives) or hydra/sweeper/sampler=nsgaii"]
    assert not (tmp_path / "sweep").exists()  # refused before the study was made


def test_an_app_with_its_own_trial_and_tracking_nodes_gets_a_plain_sweep(tmp_path: Path) -> None:
    """Only an app that declares a sweep hook (runner) gets trial.* overrides and an MLflow parent run."""
    sweep(tmp_path, "loom")
    trials = study(tmp_path, "loom").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    flaws = load("loom").flaws
    for t in trials:
        assert t.value == pytest.approx(flaws(t.params["tension"], t.params["picks"], t.params["trial.pattern"]))
        overrides = yaml.safe_load((tmp_path / "sweep" / str(t.number) / ".hydra" / "overrides.yaml").read_text())
        assert sorted(o.split("=")[0] for o in overrides) == ["picks", "tension", "trial.pattern"]
    assert not (tmp_path / "loom.db").exists() and not (tmp_path / "mlruns").exists()  # no parent run anywhere
