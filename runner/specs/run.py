"""The run spec: the one contract between Hydra's composed config and everything that runs.

Hydra composes conf/ once; `RunSpec.from_config` turns the result into frozen, typed dataclasses, one
per config group (each in the module of runner/specs/ named after its group), checking every key, type
and range so that bad input fails before anything starts. From then on nothing reads the raw
DictConfig: `spec.yaml` (see `to_yaml`/`from_yaml`) is all a worker, a resumed run or a reproduced run
needs.

Every field carries its help text and its allowed range (`opt`); runner/specs/fields.py builds the
dataclasses from plain data and checks them. Rules across fields live in `RunSpec.validate`; those
that need the task (metric names, directions) run after the spec is built, as a step of their own
(runner/specs/metric_names.py: `with_task_declarations`).

Callers take `RunSpec` and `SpecError` from here, a group's spec from its module.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from runner.specs import composition
from runner.specs.accumulation import AccumulationSpec, check_accum_shorthand
from runner.specs.dataset import DatasetSpec, check_dataset
from runner.specs.fields import SpecError, build, did_you_mean, flat_keys, opt, to_plain
from runner.specs.model import ModelSpec
from runner.specs.modes import EvalSpec, PredictSpec, WeightsSpec, check_mode
from runner.specs.objective import ObjectiveSpec
from runner.specs.optimizer import OptimizerSpec
from runner.specs.peer_names import peer_option_hint
from runner.specs.parallelism import ParallelismSpec, PlanSpec, check_parallelism
from runner.specs.precision import PrecisionSpec
from runner.specs.scheduler import SchedulerSpec
from runner.specs.task import TaskSpec
from runner.specs.tracking import TrackingSpec
from runner.specs.trainer import CallbackSpec, TrainerSpec, callbacks_refusal, check_cross_validation, check_trainer
from runner.specs.trial import TrialSpec
from runner.specs.tune import TuneSpec, check_tune

__all__ = ["SpecError", "RunSpec", "OPTION_GROUPS", "COMPONENT_GROUPS", "check_option"]


@dataclass(frozen=True)
class RunSpec:
    mode: Literal["train", "eval", "predict", "export"] = opt("train", "train, or eval/predict/export a trained run")
    seed: int = opt(0, "seed of model init, data order and dropout", ge=0, lt=2**63)
    run_dir: str = opt("outputs/runs/unnamed", "where this run writes spec.yaml, checkpoints and plots")
    overrides: tuple[str, ...] = opt((), "the command-line overrides this run was composed from")
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    task: TaskSpec = field(default_factory=TaskSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    accumulation: AccumulationSpec = field(default_factory=AccumulationSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    trial: TrialSpec = field(default_factory=TrialSpec)
    tune: TuneSpec = field(default_factory=TuneSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    predict: PredictSpec = field(default_factory=PredictSpec)
    weights: WeightsSpec = field(default_factory=WeightsSpec)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: dict, overrides: tuple[str, ...] = ()) -> "RunSpec":
        """Build from Hydra's composed config (as a plain dict), reading `accum` as the shorthand."""
        cfg = dict(cfg)
        cfg.pop("hydra", None)
        accum = cfg.pop("accum", None)
        if accum is not None:
            check_accum_shorthand(accum, cfg, overrides)
            cfg["accumulation"] = {**(cfg.get("accumulation") or {}), "steps": accum}
        cfg["overrides"] = list(overrides)
        spec = build(cls, _with_components(cfg), "")
        spec.validate()
        return spec

    @classmethod
    def from_yaml(cls, text: str) -> "RunSpec":
        spec = build(cls, _with_components(yaml.safe_load(text) or {}), "")
        spec.validate()
        return spec

    def to_dict(self) -> dict:
        return to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params."""
        return flat_keys(self.to_dict())

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    # --- cross-field rules --------------------------------------------------------------------

    def validate(self) -> None:
        """The rules across keys that need no task; each group's own are in its module."""
        for group in OPTION_GROUPS:
            check_option(group, getattr(self, group).name, f"{group}.name")
        check_trainer(self.trainer)
        check_parallelism(self.parallelism, self.dataset.batch_size, self.trainer.device)
        check_cross_validation(self)
        check_dataset(self.dataset)
        check_mode(self)
        check_tune(self.tune)
        composition.check(self)  # which feature composes with which parallel dimension


# --- config-group options: each rule once, used by the CLI and the spec ----------------------------

# the groups whose chosen option is the spec's `<group>.name`; the others are components named by
# `_target_` (their options may also come from a user's hydra.searchpath: Hydra checks those)
OPTION_GROUPS = ("precision", "parallelism", "tracking")
COMPONENT_GROUPS = ("model", "dataset", "task", "optimizer", "scheduler")


def check_option(group: str, value: Any, key: str | None = None, searchpath: tuple[str, ...] = ()) -> None:
    """Refuse an option of a config group that has no <group>/<value>.yaml in conf/ or on the search path."""
    from runner.specs import registry  # late: the registry lists conf/, which only this check needs

    allowed = registry.options(group, searchpath)
    if value not in allowed:
        hint = peer_option_hint(group, str(value)) or did_you_mean(str(value), allowed)
        raise SpecError(f"{key or group}: unknown option {value!r}; {hint}"
                        f"choose one of {', '.join(allowed)}")


def _with_components(cfg: dict) -> dict:
    """The component nodes parsed as components (their keys belong to their _target_)."""
    cfg = dict(cfg)
    for group, spec_class in _COMPONENTS.items():
        if group in cfg:
            cfg[group] = spec_class.parse(cfg[group], group)
    trainer = cfg.get("trainer")
    if isinstance(trainer, dict) and not isinstance(trainer.get("callbacks", ()), (list, tuple)):
        raise SpecError(callbacks_refusal(trainer["callbacks"]))
    if isinstance(trainer, dict) and isinstance(trainer.get("callbacks"), (list, tuple)):
        cfg["trainer"] = {**trainer, "callbacks": [CallbackSpec.parse(c, f"trainer.callbacks[{i}]")
                                                   for i, c in enumerate(trainer["callbacks"])]}
    par = cfg.get("parallelism")
    if isinstance(par, dict):
        plans = {k: PlanSpec.parse(par[k], f"parallelism.{k}") for k in ("tp_plan", "pp_plan") if par.get(k) is not None}
        cfg["parallelism"] = {**par, **plans}
    return cfg


_COMPONENTS = {"model": ModelSpec, "dataset": DatasetSpec, "task": TaskSpec, "optimizer": OptimizerSpec,
               "scheduler": SchedulerSpec}
