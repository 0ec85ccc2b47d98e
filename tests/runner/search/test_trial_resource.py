"""Hyperband's resource in one unit: what the sweeper gives the pruner as max_resource and the steps a
trial reports at (runner/search/trial.py), on the digits study's composed config."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import optuna
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hydra_plugins.runner_optuna_sweeper._builders import pruner_config
from runner.addons.base import Progress
from runner.specs.registry import CONF_DIR
from runner.search.trial import PRUNER_ATTR, open_storage, open_trial
from tests.conftest import compose_spec

HYPERBAND = OmegaConf.create({"_target_": "optuna.pruners.HyperbandPruner", "min_resource": 1,
                              "max_resource": "auto", "reduction_factor": 3, "bootstrap_count": 0})


def reported(tmp_path: Path, overrides: list[str], progress: Progress) -> tuple[dict, list[int]]:
    """The pruner's config as the sweeper makes it, and the steps a trial's run reports at."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    pruner = pruner_config(HYPERBAND, cfg)
    journal = tmp_path / "study.journal"
    study = optuna.create_study(study_name="s", storage=open_storage(str(journal)), direction="maximize")
    study.set_user_attr(PRUNER_ATTR, pruner)
    number = study.ask().number
    spec = compose_spec([*overrides, f"trial.storage={journal}", "trial.study_name=s", f"trial.number={number}"],
                        tmp_path / "run")
    reporter = open_trial(spec)
    reporter.setup(SimpleNamespace(progress=progress, tracker=None, total_steps=1000))
    assert reporter.after_evaluation({spec.objective.metric: 0.5}) is None
    return pruner, list(optuna.load_study(study_name="s", storage=open_storage(str(journal))).trials[0].intermediate_values)


def test_a_run_evaluated_per_epoch_reports_epochs_and_hyperband_counts_epochs(tmp_path: Path) -> None:
    """Before: max_resource = trainer.max_epochs (3) while the trial reported at its optimizer step (20)."""
    pruner, steps = reported(tmp_path, ["trainer.max_epochs=3"], Progress(step=20, epoch=1))
    assert pruner["max_resource"] == 3 and steps == [1]


def test_a_run_evaluated_every_n_steps_reports_steps_and_hyperband_takes_its_unit_from_the_trials(tmp_path: Path) -> None:
    pruner, steps = reported(tmp_path, ["trainer.max_steps=60", "trainer.eval_every_n_steps=20"], Progress(step=20, epoch=0))
    assert pruner["max_resource"] == "auto" and steps == [20]


def test_a_trial_that_has_done_all_its_work_completes_rather_than_being_pruned(tmp_path: Path) -> None:
    """Issue 35 item 11: trials trained to the end were "pruned at epoch 3" and their values lost. A pruner
    that rejects every value still stops a trial mid-run; at the run's last step the value is reported and
    the trial goes on to complete."""
    journal = tmp_path / "study.journal"
    study = optuna.create_study(study_name="s", storage=open_storage(str(journal)), direction="maximize")
    study.set_user_attr(PRUNER_ATTR, {"_target_": "optuna.pruners.ThresholdPruner", "lower": 2.0})  # prunes any acc
    verdicts = []
    for _ in range(2):
        number = study.ask().number
        spec = compose_spec(["trainer.max_epochs=3", f"trial.storage={journal}", "trial.study_name=s",
                             f"trial.number={number}"], tmp_path / f"run{number}")
        reporter, progress = open_trial(spec), Progress()
        reporter.setup(SimpleNamespace(progress=progress, tracker=None, total_steps=60))
        progress.step, progress.epoch = (20, 1) if number == 0 else (60, 3)
        verdicts.append(reporter.after_evaluation({spec.objective.metric: 0.9481}))
    assert verdicts[0].pruned and verdicts[0].reason.startswith("trial 0 pruned at epoch 1 (step 20): val/acc 0.9481")
    assert verdicts[1] is None
    trials = optuna.load_study(study_name="s", storage=open_storage(str(journal))).trials
    assert [t.intermediate_values for t in trials] == [{1: 0.9481}, {3: 0.9481}]
