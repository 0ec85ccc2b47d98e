"""`python -m runner [overrides]`: Hydra composes conf/ once; the run spec takes it from there.

Before Hydra starts the run, runner/cli/preflight.py checks everything a user can get wrong without
importing torch, MLflow or Optuna; a mistake is one `error: <key>: ...` line and exit code 2. A single
run is then run from the config preflight composed (run_composed); a multirun, and the modes that are
Hydra's own business, go through hydra.main.
"""
from __future__ import annotations

from runner import startup_gc

if __name__ == "__main__":  # `python -m runner`: from here, not from a test's import of this module
    startup_gc.pause()  # runner/startup_gc.py: the collector walks none of the start-up's objects

import logging
import sys

import hydra
from omegaconf import DictConfig

from hydra_plugins.runner_optuna_sweeper.hook import sweep_hook
from runner.specs import registry
from runner.cli.preflight import CONFIG_NAME, Checked, expand_accum, fail, preflight, resolved
from runner.cli.run_dir import shared_run_dir_overrides, under_torchrun
from runner.specs.metric_names import with_task_declarations
from runner.specs.run import RunSpec, SpecError


@hydra.main(config_path=str(registry.CONF_DIR), config_name=CONFIG_NAME, version_base="1.3")
@sweep_hook("runner.search.sweep_hook.RunnerSweepHook")  # what the Optuna sweeper adds to runner's jobs
def main(cfg: DictConfig) -> float:
    try:
        spec = spec_from_hydra(cfg)
    except SpecError as e:
        fail(str(e))
    if not trains_one_engine_here(spec):  # an engine built and dropped (a finder's, a fold's) must not be frozen
        startup_gc.resume()
    # torch, MLflow and the engine: only now that the spec is known to be good
    from runner.engine.checkpoint import CheckpointWriteError, NonFiniteCheckpoint
    from runner.cli.launch import WorkersFailed, run
    from runner.engine.monitor import Diverged

    try:
        return run(spec).objective
    except SpecError as e:
        _to_job_log(f"error: {e}")
        fail(str(e))
    except (Diverged, NonFiniteCheckpoint, CheckpointWriteError) as e:  # the run failed, not the input
        _to_job_log(f"error: {e}")
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except WorkersFailed as e:
        _to_job_log(f"runner: {e}")
        print(f"runner: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:  # out of memory, or the user's own component raised: one line, not runner's traceback
        from runner.cli.out_of_memory import out_of_memory_line
        from runner.cli.user_code import user_failure

        line = out_of_memory_line(e, spec) or user_failure(e, spec)
        if line is None:
            raise
        _to_job_log(f"error: {line}")
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(1)


def trains_one_engine_here(spec: RunSpec) -> bool:
    """Whether this process builds one engine and trains it (the engine's build then freezes the start-up's objects:
    runner/startup_gc.py): not a finder's run or k-fold's, the modes that train nothing, or a launcher of workers."""
    from runner.specs.parallelism import nominal_world

    return (spec.mode == "train" and not spec.tune.name and not spec.trainer.cross_validation.folds
            and spec.parallelism.name == "single" and nominal_world(spec.parallelism) == 1)


def _to_job_log(line: str) -> None:
    """The line also in the job's own log file (Hydra's file handler on the root logger): a sweep's trial log
    then says why the trial failed. The console gets it once, from the print that follows."""
    record = logging.makeLogRecord({"name": "runner", "levelno": logging.ERROR, "levelname": "ERROR", "msg": line})
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(record)


def spec_from_hydra(cfg: DictConfig) -> RunSpec:
    """The RunSpec of the job Hydra is running (its run directory is the job's output directory), with the
    task's declarations applied (its objective's direction resolved)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    container = resolved(cfg)
    container["run_dir"] = hydra_cfg.runtime.output_dir
    return with_task_declarations(RunSpec.from_config(container, tuple(hydra_cfg.overrides.task)))


def run_composed(checked: Checked) -> None:
    """A single run from the config preflight composed and checked, as hydra.main runs one: Hydra's logging,
    its callbacks, and its run_job (the run directory, .hydra/, the job's log file, hydra.job.env_set and
    chdir, HydraConfig), with Hydra's own report of an exception that escapes the job. hydra.main would
    compose the same config twice more first (once to read hydra.mode, once to run): 0.3-0.5 s of start-up."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import read_write

    cfg = checked.config
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    with read_write(cfg.hydra):
        cfg.hydra.mode = RunMode.RUN

    def run() -> None:
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=cfg.hydra.job.config_name)
        ret = run_job(hydra_context=HydraContext(config_loader=checked.config_loader, callbacks=callbacks),
                      task_function=main, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None)
        callbacks.on_run_end(config=cfg, config_name=cfg.hydra.job.config_name, job_return=ret)
        ret.return_value  # noqa: B018 -- raises the job's exception, as Hydra's run does

    # as under hydra.main, Hydra is initialized while the job runs: a user's code may compose configs there
    GlobalHydra.instance().initialize(Hydra(task_name=cfg.hydra.job.name, config_loader=checked.config_loader))
    try:
        run_and_report(run)
    finally:
        GlobalHydra.instance().clear()


# `runner <subcommand> ...`: a first argument Hydra would never take (an override holds `=`)
SUBCOMMANDS = {"reproduce": "runner.results.reproduce", "compare": "runner.results.compare"}


def cli() -> None:
    startup_gc.pause()  # (the `runner` script's entry: the module was imported, not run)
    try:
        _cli()
    finally:
        startup_gc.end()


def _cli() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        import importlib

        startup_gc.resume()
        sys.exit(importlib.import_module(SUBCOMMANDS[sys.argv[1]]).main(sys.argv[2:]))
    if under_torchrun():  # a rank under the user's own torchrun: it ends with torchrun's agent (runner/cli/lifetime.py)
        from runner.cli import lifetime

        lifetime.end_with_parent()
    sys.argv[1:] = expand_accum(sys.argv[1:])
    checked = preflight(sys.argv[1:])
    if under_torchrun() and "-m" not in sys.argv and "--multirun" not in sys.argv:
        sys.argv += shared_run_dir_overrides(checked.run_dir)
    try:
        if checked.config is not None and not under_torchrun():
            run_composed(checked)
        else:  # a multirun's jobs, torchrun's ranks, Hydra's own modes: the collector as usual
            startup_gc.resume()
            main()
        if under_torchrun():  # a rank that finished: ended before the interpreter's teardown, as a worker is
            from runner.cli.worker import exit_before_teardown

            exit_before_teardown()
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP (runner.engine.preemption.Stopped)
        requeued = f"; SLURM job {e.requeued_job} requeued to continue it" if getattr(e, "requeued_job", "") else ""
        print(f"runner: {str(e) or 'interrupted'}; the run was marked KILLED{requeued}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 130))


if __name__ == "__main__":
    cli()
