"""An Optuna sweeper for Hydra (`hydra/sweeper=runner_optuna`; also `optuna` where hydra-optuna-sweeper
is not installed), its own distribution: sweeper/ in runner's repository, `pip install ./sweeper`.

hydra-optuna-sweeper's config on current Optuna, plus pruning fed by the jobs, parallel trial
slots that refill as each trial ends, studies resumed or shared by naming their storage, failed and
killed trials recorded rather than fatal. It imports neither runner nor torch: an app adds its own
extras through the hook its task function declares (hook.py; runner's: an MLflow parent run per
sweep and trial reporting, runner/search/sweep_hook.py). See config.py for the config, _impl.py for the
study loop, _study.py for which study a sweep runs, _checks.py for what is refused up front.
"""
