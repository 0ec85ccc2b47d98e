"""`hydra/sweeper=pbt`'s sweep: the base spec composed once, the population run, the MLflow parent run.

The parent (runner.search.sweep_hook.ParentRun) gets `pbt/best_objective` at each round's boundary and, at the
end, the winner's hyperparameter schedule along its lineage (pbt_winner_schedule.json) and its tags.
Each member's run is a child of it. A rerun with the same hydra.sweep.dir goes on with the same parent.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.engine import preemption
from runner.search.pbt import explore
from runner.search.pbt import launcher as members_launcher
from runner.search.pbt.explore import mlflow_key
from runner.search.pbt.population import Population, Settings, ranked
from runner.search.sweep_summary import run_link
from runner.cli.preflight import resolved
from runner.specs import composition
from runner.specs.metric_names import with_task_declarations
from runner.specs.run import RunSpec

log = logging.getLogger(__name__)
PARENT_FILE = "pbt_parent_run_id"


def split_arguments(arguments: list[str]) -> tuple[list[str], dict[str, str]]:
    """Command-line overrides: fixed values for every member, and sweeps (interval, choice) for the space."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    fixed, sweeps = [], {}
    for override in OverridesParser.create().parse_overrides(arguments):
        if override.is_sweep_override():
            sweeps[override.get_key_element()] = override.input_line.split("=", 1)[1]
        else:
            fixed.append(override.input_line)
    return fixed, sweeps


def run_sweep(settings: dict[str, Any], arguments: list[str], config: DictConfig, config_loader: Any,
              on_round: Any = None, launcher: Any = None) -> float:
    """`launcher`: the Hydra launcher the user chose, set up with runner/search/pbt/launcher.py's member_task;
    basic (or None) keeps PBT's own processes."""
    settings = dict(settings)
    settings.pop("_target_", None)
    fixed, sweeps = split_arguments(arguments)
    texts = {**(settings.pop("params", None) or {}), **sweeps}
    space = explore.parse_space(texts)  # before anything is made
    settings["perturb"] = tuple(float(f) for f in settings.get("perturb", (0.8, 1.2)))
    pbt = Settings(**settings)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    cfg = config_loader.load_sweep_config(config, list(fixed))
    container = resolved(cfg)
    container["run_dir"] = str(sweep_dir / "base")
    base = with_task_declarations(RunSpec.from_config(container, tuple(fixed)))  # its objective's direction ranks members
    pbt.check(base)
    composition.check_feature("pbt", "hydra/sweeper=pbt", base)  # members train in one process each
    _check_bounds(base, space, texts)
    launched = None
    if not members_launcher.is_basic(launcher):
        members_launcher.check(launcher, pbt.n_jobs)  # one that cannot serve: one line, before anything is made
    parent = _open_parent(cfg, sweep_dir, base, pbt, space)
    status = "FAILED"
    alive = None
    if not members_launcher.is_basic(launcher):
        alive = members_launcher.SweepAlive(sweep_dir).start()
        launched = members_launcher.LauncherMembers(launcher, fixed, pbt.n_jobs, alive)
    try:
        # SIGTERM/SIGHUP between members' training (ranking, exploit, waiting on member processes) stop the
        # sweep as Ctrl-C does: members stopped, the parent KILLED, one line; inside an in-process member's
        # training its own handler stops it at a step boundary first
        with preemption.handled(), _job_console():
            state = Population(base, space, pbt, sweep_dir, parent.run_id if parent else None, on_round,
                               launched).run()
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if alive is not None:  # the members stop with the sweep
            alive.stop()
        if parent is not None and status != "FINISHED":
            parent.finish(status)
    link = None
    best = ranked(state["members"], base.objective.direction == "maximize")[0]
    schedule = {"member": best["id"], "objective": best["objectives"][-1][1], "metric": base.objective.metric,
                "schedule": [{"from_step": s, **h} for s, h in best["schedule"]], "lineage": best["lineage"]}
    (sweep_dir / "pbt_winner_schedule.json").write_text(json.dumps(schedule, indent=1))
    if parent is not None:
        parent.client.log_artifact(parent.run_id, str(sweep_dir / "pbt_winner_schedule.json"))
        parent.client.set_tag(parent.run_id, "pbt.winner", f"member {best['id']} ({best['run_id']})")
        if math.isfinite(schedule["objective"]):
            parent.client.log_metric(parent.run_id, "best_objective", schedule["objective"])
        link = run_link(parent.client, parent.uri, parent.run_id)  # the members' summaries leave it to the parent
        parent.finish("FINISHED")
    print(f"PBT: best {base.objective.metric} {schedule['objective']:.4f} (member {best['id']}, {best['run_dir']})\n"
          f"  its schedule: " + "; ".join(f"from step {s}: " + ", ".join(f"{k}={v:.4g}" for k, v in h.items())
                                          for s, h in best["schedule"]) +
          f"\n  sweep directory: {sweep_dir}" + (f"\n  parent MLflow run: {link}" if link else ""), flush=True)
    return schedule["objective"]


@contextlib.contextmanager
def _job_console() -> Any:
    """Members that train in this process, and PBT's rounds, print as a job's lines do: the message alone. The
    sweep process logs through Hydra's own console handler, which stamps each line `[time][HYDRA]`."""
    handlers = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]  # not its files
    formats = [h.formatter for h in handlers]
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        yield
    finally:
        for handler, fmt in zip(handlers, formats):
            handler.setFormatter(fmt)


def _check_bounds(base: RunSpec, space: dict[str, explore.Dim], texts: dict[str, str]) -> None:
    """Every value a member may get is one its run takes: the spec's own check on each end of an interval (the
    checks are ranges, so what lies between passes too) and on each choice, before any member starts. A member
    refused later would name a sampled value, not the interval the user typed."""
    import yaml

    from runner.specs.fields import set_dotted
    from runner.specs.run import SpecError

    for key, dim in space.items():
        ends = dim.choices or (dim.low, dim.high)
        for which, value in zip(("choice",) * len(ends) if dim.choices else ("low", "high"), ends):
            tree = base.to_dict()
            set_dotted(tree, key, value)
            try:
                RunSpec.from_yaml(yaml.safe_dump(tree))
            except SpecError as e:
                reason = str(e).removeprefix(f"{key}: ")
                raise SpecError(f"{key}: {texts[key]}: its {which} {reason}") from None


def _open_parent(cfg: DictConfig, sweep_dir: Path, base: RunSpec, pbt: Settings, space: dict) -> Any:
    from runner.search.sweep_hook import ParentRun

    parent = ParentRun.from_config(cfg)
    if parent is None:
        return None
    sweep_dir.mkdir(parents=True, exist_ok=True)
    saved = sweep_dir / PARENT_FILE
    reuse = saved.read_text().strip() if saved.is_file() else None
    params = {"pbt.population": pbt.population, "pbt.ready": pbt.ready, "pbt.quantile": pbt.quantile,
              "pbt.explore": pbt.explore, **{f"space.{mlflow_key(k)}": d for k, d in space.items()}}
    parent.start(name=f"pbt {' '.join(base.overrides)}"[:200], tags={"runner.sweeper": "pbt", "sweep_dir": str(sweep_dir)},
                 params=params, reuse=reuse)
    saved.write_text(parent.run_id)
    return parent
