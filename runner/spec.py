"""The run spec: the one contract between Hydra's composed config and everything that runs.

Hydra composes conf/ once; `RunSpec.from_config` turns the result into frozen, typed dataclasses,
checking every key, type and range so that bad input fails before anything starts. From then on
nothing reads the raw DictConfig: `spec.yaml` (see `to_yaml`/`from_yaml`) is all a worker, a
resumed run or a reproduced run needs.

Every field carries its help text and its allowed range in `field(metadata=...)`; `_check` reads them.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional

import yaml


class SpecError(ValueError):
    """Bad user input: one line naming the key, the bad value and what is allowed."""


def opt(default: Any, help: str, *, gt: float | None = None, ge: float | None = None,
        le: float | None = None, lt: float | None = None) -> Any:
    """A spec field with its help text and numeric bounds."""
    meta = {"help": help, "gt": gt, "ge": ge, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DatasetSpec:
    name: str = opt("digits", "dataset option (conf/dataset/<name>.yaml)")
    batch_size: int = opt(64, "samples per device per micro-step", gt=0)
    root: str = opt("datasets", "directory that datasets live in (relative to the working directory)")
    download: bool = opt(False, "let torchvision datasets download when missing (needs a network)")
    num_workers: int = opt(0, "DataLoader worker processes", ge=0)
    val_fraction: float = opt(0.15, "share of the data held out for validation", ge=0, lt=1)
    test_fraction: float = opt(0.15, "share of the data held out for testing", ge=0, lt=1)
    split_seed: int = opt(0, "seed of the train/val/test split (independent of the run seed)")
    # synthetic
    shape: tuple[int, ...] = opt((3, 32, 32), "synthetic: shape of one input sample")
    num_classes: int = opt(10, "synthetic: number of classes", gt=1)
    size: int = opt(2048, "synthetic: number of samples", gt=0)


@dataclass(frozen=True)
class ModelSpec:
    name: str = opt("mlp", "model option (conf/model/<name>.yaml)")
    hidden: tuple[int, ...] = opt((256, 128), "mlp: hidden layer widths")
    channels: tuple[int, ...] = opt((32, 64), "cnn: channels of each conv block")
    dropout: float = opt(0.0, "dropout probability", ge=0, lt=1)
    norm: bool = opt(False, "mlp/cnn: use normalization layers (LayerNorm / BatchNorm)")
    small_stem: bool = opt(True, "resnet18: 3x3 stride-1 stem without max-pool, for small images")


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = opt("adam", "optimizer option (conf/optimizer/<name>.yaml)")
    lr: float = opt(1e-3, "peak learning rate", gt=0)
    weight_decay: float = opt(0.0, "weight decay", ge=0)
    decay_norm_and_bias: bool = opt(False, "also decay biases and normalization weights")
    momentum: float = opt(0.9, "sgd/rmsprop momentum; muon momentum", ge=0, lt=1)
    nesterov: bool = opt(False, "sgd/muon: Nesterov momentum")
    betas: tuple[float, ...] = opt((0.9, 0.999), "adam/adamw/lamb betas")
    eps: float = opt(1e-8, "numerical-stability epsilon", gt=0)
    alpha: float = opt(0.99, "rmsprop smoothing constant", gt=0, lt=1)
    impl: str = opt("auto", "kernel: auto (fused on CUDA where supported, else foreach), fused, foreach, for_loop")


@dataclass(frozen=True)
class SchedulerSpec:
    name: str = opt("constant", "scheduler option (conf/scheduler/<name>.yaml)")
    warmup: float = opt(0.0, "warmup: optimizer steps if >= 1, a fraction of all steps if < 1", ge=0)
    min_lr_ratio: float = opt(0.0, "final lr as a fraction of the peak lr (cosine, warmup_cosine, sgdr, wsd; plateau's floor)", ge=0, le=1)
    step_size: int = opt(100, "step/exponential: optimizer steps per decay by gamma", gt=0)
    gamma: float = opt(0.1, "step/multistep/exponential: decay factor", gt=0, le=1)
    milestones: tuple[float, ...] = opt((0.5, 0.75), "multistep: steps (>= 1) or fractions (< 1) where lr decays")
    cycle_steps: float = opt(0.25, "sgdr/cyclic: first cycle length, steps or fraction", gt=0)
    cycle_mult: float = opt(1.0, "sgdr: cycle length multiplier after each restart", ge=1)
    base_lr_ratio: float = opt(0.1, "cyclic/onecycle: lowest lr as a fraction of the peak", gt=0, le=1)
    pct_start: float = opt(0.3, "onecycle: fraction of steps spent increasing lr", gt=0, lt=1)
    decay: float = opt(0.2, "wsd: final decay phase, steps or fraction", gt=0)
    patience: int = opt(3, "plateau: evaluations without improvement before decaying", ge=0)
    factor: float = opt(0.5, "plateau: decay factor", gt=0, lt=1)
    monitor: str = opt("val/loss", "plateau: metric to watch")
    mode: Literal["min", "max"] = opt("min", "plateau: whether the monitored metric should fall or rise")


@dataclass(frozen=True)
class PrecisionSpec:
    name: Literal["fp32", "tf32", "fp16", "bf16", "bf16_true", "fp8"] = opt("fp32", "numeric precision")
    init_scale: float = opt(2.0 ** 16, "fp16: initial loss scale", gt=0)


@dataclass(frozen=True)
class ParallelismSpec:
    name: Literal["single", "ddp", "fsdp"] = opt("single", "single process, DDP replicas, or FSDP2 shards")
    nproc_per_node: int = opt(1, "worker processes per node (one device each)", gt=0)
    nnodes: int = opt(1, "machines taking part; each runs the same command", gt=0)
    node_rank: int = opt(0, "this machine's index; node 0 hosts the rendezvous store", ge=0)
    rdzv_endpoint: str = opt("127.0.0.1:29400", "host:port of the c10d rendezvous (node 0's address) when nnodes > 1")
    rdzv_timeout: float = opt(120.0, "seconds to wait for every node to join before giving up", gt=0)
    max_restarts: int = opt(0, "elastic restarts of the worker group after a worker dies (resumes from the last checkpoint)", ge=0)


@dataclass(frozen=True)
class AccumulationSpec:
    steps: int = opt(1, "micro-batches per optimizer step (shorthand: +accum=N)", gt=0)


@dataclass(frozen=True)
class EarlyStoppingSpec:
    monitor: Optional[str] = opt(None, "metric to watch, e.g. val/loss; null turns early stopping off")
    mode: Literal["min", "max"] = opt("min", "whether the monitored metric should fall or rise")
    patience: int = opt(5, "evaluations without improvement before stopping", gt=0)
    min_delta: float = opt(0.0, "smallest change that counts as improvement", ge=0)


@dataclass(frozen=True)
class TrainerSpec:
    max_epochs: int = opt(10, "epochs to train", gt=0)
    max_steps: Optional[int] = opt(None, "optimizer steps to train; wins over max_epochs when set", gt=0)
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "device: auto picks cuda when available")
    eval_every_n_steps: int = opt(0, "evaluate every N optimizer steps (0: off)", ge=0)
    eval_every_epoch: bool = opt(True, "evaluate at the end of every epoch")
    clip_grad_norm: Optional[float] = opt(None, "clip the global gradient norm to this value", gt=0)
    clip_grad_value: Optional[float] = opt(None, "clip each gradient element to +-value", gt=0)
    log_every_n_steps: int = opt(10, "log training metrics every N optimizer steps", gt=0)
    checkpoint_every_n_steps: int = opt(0, "write a checkpoint every N optimizer steps (0: only at the end)", ge=0)
    keep_checkpoints: int = opt(2, "step checkpoints kept on disk (the newest)", gt=0)
    resume: Optional[str] = opt(None, "checkpoint file or run directory to resume from")
    progress_bar: Literal["auto", "on", "off"] = opt("auto", "auto: only when stderr is a terminal")
    compile: bool = opt(False, "torch.compile the model")
    deterministic: bool = opt(False, "use deterministic algorithms (slower)")
    early_stopping: EarlyStoppingSpec = field(default_factory=EarlyStoppingSpec)


@dataclass(frozen=True)
class TrackingSpec:
    name: Literal["mlflow", "none"] = opt("mlflow", "mlflow, or none for no tracking at all")
    uri: str = opt("sqlite:///outputs/mlflow.db", "MLflow tracking URI")
    experiment: str = opt("runner", "MLflow experiment name")
    artifact_root: str = opt("outputs/mlartifacts", "artifact location for new experiments on a local store")
    run_name: Optional[str] = opt(None, "MLflow run name; default: built from the overrides")


@dataclass(frozen=True)
class ObjectiveSpec:
    metric: str = opt("val/acc", "metric returned to sweeps (best value over evaluations)")
    direction: Literal["maximize", "minimize"] = opt("maximize", "whether higher is better")


@dataclass(frozen=True)
class TrialSpec:
    """Set by the Optuna sweeper (hparams_search): the job finds its trial in the study's storage."""

    storage: Optional[str] = opt(None, "Optuna storage of the study this run is a trial of")
    study_name: Optional[str] = opt(None, "name of that study")
    number: Optional[int] = opt(None, "this run's trial number in the study", ge=0)


@dataclass(frozen=True)
class RunSpec:
    seed: int = opt(0, "seed of model init, data order and dropout")
    run_dir: str = opt("outputs/runs/unnamed", "where this run writes spec.yaml, checkpoints and plots")
    overrides: tuple[str, ...] = opt((), "the command-line overrides this run was composed from")
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    accumulation: AccumulationSpec = field(default_factory=AccumulationSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    trial: TrialSpec = field(default_factory=TrialSpec)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: dict, overrides: tuple[str, ...] = ()) -> "RunSpec":
        """Build from Hydra's composed config (as a plain dict), reading `accum` as the shorthand."""
        cfg = dict(cfg)
        cfg.pop("hydra", None)
        accum = cfg.pop("accum", None)
        if accum is not None:
            _check_accum_shorthand(accum, cfg, overrides)
            cfg["accumulation"] = {**(cfg.get("accumulation") or {}), "steps": accum}
        cfg["overrides"] = list(overrides)
        spec = _build(cls, cfg, "")
        spec.validate()
        return spec

    @classmethod
    def from_yaml(cls, text: str) -> "RunSpec":
        spec = _build(cls, yaml.safe_load(text) or {}, "")
        spec.validate()
        return spec

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params."""
        out: dict[str, Any] = {}

        def walk(node: Any, prefix: str) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, f"{prefix}{key}.")
            else:
                out[prefix[:-1]] = node

        walk(self.to_dict(), "")
        return out

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    # --- cross-field rules --------------------------------------------------------------------

    def validate(self) -> None:
        from runner import registry  # late: the registry lists conf/ options

        for group, value in (("dataset", self.dataset.name), ("model", self.model.name),
                             ("optimizer", self.optimizer.name), ("scheduler", self.scheduler.name)):
            allowed = registry.options(group)
            if value not in allowed:
                raise SpecError(f"{group}.name: unknown option {value!r}; choose one of {', '.join(allowed)}")
        impls = ("auto", "fused", "foreach", "for_loop")
        if self.optimizer.impl not in impls:
            raise SpecError(f"optimizer.impl: {self.optimizer.impl!r} is not allowed; choose one of {', '.join(impls)}")
        if len(self.optimizer.betas) != 2 or not all(0 <= b < 1 for b in self.optimizer.betas):
            raise SpecError(f"optimizer.betas: {list(self.optimizer.betas)} is not allowed; give two numbers in [0, 1)")
        if self.trainer.clip_grad_norm is not None and self.trainer.clip_grad_value is not None:
            raise SpecError("trainer.clip_grad_value: set either clip_grad_norm or clip_grad_value, not both")
        if any(d <= 0 for d in self.dataset.shape):
            raise SpecError(f"dataset.shape: {list(self.dataset.shape)} is not allowed; every size must be > 0")
        par = self.parallelism
        if par.node_rank >= par.nnodes:
            raise SpecError(f"parallelism.node_rank: {par.node_rank} is out of range; allowed: 0 to nnodes-1 ({par.nnodes - 1})")
        host, _, port = par.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise SpecError(f"parallelism.rdzv_endpoint: {par.rdzv_endpoint!r} is not host:port; e.g. 10.0.0.1:29400")
        if self.dataset.val_fraction + self.dataset.test_fraction >= 1:
            raise SpecError("dataset.val_fraction: val_fraction + test_fraction must be < 1")


def _check_accum_shorthand(accum: Any, cfg: dict, overrides: tuple[str, ...]) -> None:
    explicit = [o for o in overrides if o.lstrip("+~").startswith("accumulation.steps=")]
    if explicit:
        steps = (cfg.get("accumulation") or {}).get("steps")
        if steps != accum:
            raise SpecError(f"accum: +accum={accum} conflicts with accumulation.steps={steps}; set only one")


# --- generic typed building ---------------------------------------------------------------------


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"{prefix[:-1] or 'spec'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise SpecError(f"{key}: unknown key; allowed keys under {prefix[:-1] or 'the root'}: {', '.join(sorted(known))}")
    values = {}
    for name, value in data.items():
        f = known[name]
        values[name] = _convert(hints[name], value, f"{prefix}{name}", f.metadata)
    return cls(**values)


def _convert(tp: Any, value: Any, key: str, meta: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, key + ".")
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _convert(inner, value, key, meta)
    if origin is Literal:
        if value not in args:
            raise SpecError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"{key}: {value!r} is not a list; expected a list like [{', '.join('1' for _ in range(2))}]")
        return tuple(_convert(args[0], v, f"{key}[{i}]", None) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{key}: {value!r} is not a boolean; use true or false")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{key}: {value!r} is not an integer{_range_text(meta)}")
        _check_range(key, value, meta)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise SpecError(f"{key}: {value!r} is not a number{_range_text(meta)}")
        _check_range(key, float(value), meta)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(f"{key}: {value!r} is not a string")
        return value
    raise TypeError(f"spec field {key} has an unsupported type {tp}")


def _range_text(meta: Any) -> str:
    if not meta:
        return ""
    parts = [f"{op} {meta[k]:g}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if meta.get(k) is not None]
    return f"; allowed: a value {' and '.join(parts)}" if parts else ""


def _check_range(key: str, value: float, meta: Any) -> None:
    if not meta:
        return
    bad = ((meta.get("gt") is not None and not value > meta["gt"])
           or (meta.get("ge") is not None and not value >= meta["ge"])
           or (meta.get("lt") is not None and not value < meta["lt"])
           or (meta.get("le") is not None and not value <= meta["le"]))
    if bad:
        raise SpecError(f"{key}: {value!r} is out of range{_range_text(meta)}")


def _to_plain(node: Any) -> Any:
    if dataclasses.is_dataclass(node):
        return {f.name: _to_plain(getattr(node, f.name)) for f in fields(node)}
    if isinstance(node, tuple):
        return [_to_plain(v) for v in node]
    return node
