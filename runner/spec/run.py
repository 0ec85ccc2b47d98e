"""The run spec: the one contract between Hydra's composed config and everything that runs.

Hydra composes conf/ once; `RunSpec.from_config` turns the result into frozen, typed dataclasses,
checking every key, type and range so that bad input fails before anything starts. From then on
nothing reads the raw DictConfig: `spec.yaml` (see `to_yaml`/`from_yaml`) is all a worker, a
resumed run or a reproduced run needs.

Every field carries its help text and its allowed range (`opt`); runner/spec/fields.py builds the
dataclasses from plain data and checks them. Rules across fields live in `RunSpec.validate`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

from runner.spec.fields import SpecError, build as _build, did_you_mean, flat_keys, opt, to_plain as _to_plain
from runner.spec.averaging import EmaSpec, SwaSpec, check_averaging
from runner.spec.cross_validation import CrossValidationSpec, check_cross_validation
from runner.spec.debug import DebugKeys
from runner.spec.parts import Component, OptimizerSpec, SchedulerSpec, TaskSpec, component_dict
from runner.spec.metric_names import check_metric_names, evaluation_metrics, fraction, produced_metrics
from runner.spec.modes import EvalSpec, PredictSpec, WeightsSpec, check as check_mode

__all__ = ["SpecError", "RunSpec", "opt", "check_option", "did_you_mean", "produced_metrics", "evaluation_metrics"]

DIM = 2**31 - 1  # the largest tensor dimension many kernels index; a larger one ends in a torch traceback


@dataclass(frozen=True)
class ModelSpec(Component):
    """A model named by `_target_` (a class or function returning an nn.Module) and its own arguments,
    checked against its signature by runner/spec/components.py (conf/model/<name>.yaml)."""

    target: str = "runner.models.mlp.MLP"
    params: dict = field(default_factory=dict)
    # runner's own keys (fine-tuning), never passed to the callable
    weights: Optional[str] = opt(None, "start from these weights only: a .safetensors file, a runner checkpoint or a "
                                       "state dict; a head whose shape differs is re-initialised")
    freeze: tuple[str, ...] = opt((), "globs of parameter names to freeze, e.g. ['backbone.*']")
    unfreeze_after_epochs: Optional[int] = opt(None, "unfreeze `freeze` at the start of this epoch (gradual "
                                                     "unfreezing); null: frozen for the whole run", ge=0)

    def __to_plain__(self) -> dict:
        own = {"weights": self.weights, "freeze": list(self.freeze), "unfreeze_after_epochs": self.unfreeze_after_epochs}
        return {"_target_": self.target, **self.params, **{k: v for k, v in own.items() if v not in (None, [])}}

    @classmethod
    def parse(cls, data: Any, key: str = "model") -> "ModelSpec":
        data = component_dict(data, key)
        own = {k: data.pop(k) for k in ("weights", "freeze", "unfreeze_after_epochs") if k in data}
        built = _build(_FinetuneKeys, own, f"{key}.")
        if built.unfreeze_after_epochs is not None and not built.freeze:  # it would unfreeze nothing
            raise SpecError(f"{key}.unfreeze_after_epochs: {built.unfreeze_after_epochs} needs {key}.freeze (the "
                            f"parameters to unfreeze); set {key}.freeze=['<glob>'] too, or drop it")
        return cls(target=data.pop("_target_"), params=data, weights=built.weights, freeze=built.freeze,
                   unfreeze_after_epochs=built.unfreeze_after_epochs)


@dataclass(frozen=True)
class DatasetSpec(Component):
    """A dataset builder named by `_target_` and its own arguments (conf/dataset/<name>.yaml), plus the
    loader's keys, which are runner's: the builder never sees them."""

    target: str = "runner.data.digits.build"
    # the upper bound only refuses the absurd; the engine checks the batch against the training split
    batch_size: int = opt(64, "samples per device per micro-step", gt=0, le=2**20)
    num_workers: int = opt(0, "DataLoader worker processes", ge=0)
    params: dict = field(default_factory=dict)

    def __to_plain__(self) -> dict:
        return {"_target_": self.target, "batch_size": self.batch_size, "num_workers": self.num_workers, **self.params}

    @classmethod
    def parse(cls, data: Any, key: str = "dataset") -> "DatasetSpec":
        data = component_dict(data, key)
        loader = {k: data.pop(k) for k in ("batch_size", "num_workers") if k in data}
        built = _build(_LoaderKeys, loader, f"{key}.")
        return cls(target=data.pop("_target_"), batch_size=built.batch_size, num_workers=built.num_workers, params=data)


@dataclass(frozen=True)
class _FinetuneKeys:
    weights: Optional[str] = opt(None, "weights file")
    freeze: tuple[str, ...] = opt((), "globs of parameter names to freeze")
    unfreeze_after_epochs: Optional[int] = opt(None, "epoch to unfreeze at", ge=0)


@dataclass(frozen=True)
class _LoaderKeys:
    batch_size: int = opt(64, "samples per device per micro-step", gt=0, le=2**20)
    num_workers: int = opt(0, "DataLoader worker processes", ge=0)


@dataclass(frozen=True)
class PrecisionSpec:
    name: str = opt("fp32", "numeric precision option (conf/precision/<name>.yaml)")
    init_scale: float = opt(2.0 ** 16, "fp16: initial loss scale", gt=0)


@dataclass(frozen=True)
class ParallelismSpec:
    name: str = opt("single", "parallelism option (conf/parallelism/<name>.yaml): single process, DDP replicas, FSDP2 "
                              "shards, or HSDP (shards replicated)")
    # the parallel dimensions (runner/engine/parallel/mesh.py): their product is the number of processes
    dp_replicate: int = opt(-1, "data-parallel replicas (DDP; with dp_shard > 1, HSDP's replicate dimension); "
                               "-1: the processes the other degrees leave", ge=-1)
    dp_shard: int = opt(1, "data-parallel shards (FSDP2 fully_shard); -1: the processes the other degrees leave", ge=-1)
    tp: int = opt(1, "tensor-parallel degree (not available yet: 1)", ge=-1)
    pp: int = opt(1, "pipeline-parallel degree (not available yet: 1)", ge=-1)
    cp: int = opt(1, "context-parallel degree (not available yet: 1)", ge=-1)
    nproc_per_node: int = opt(1, "worker processes per node (one device each)", gt=0)
    nnodes: int = opt(1, "machines taking part; each runs the same command", gt=0)
    node_rank: int = opt(0, "this machine's index; node 0 hosts the rendezvous store", ge=0)
    rdzv_endpoint: str = opt("127.0.0.1:29400", "host:port of the c10d rendezvous (node 0's address) when nnodes > 1")
    rdzv_timeout: float = opt(120.0, "seconds to wait for every node to join before giving up", gt=0)
    max_restarts: int = opt(0, "elastic restarts of the worker group after a worker dies (resumes from the last checkpoint)", ge=0)
    sync_batchnorm: bool = opt(False, "BatchNorm statistics over the global batch of all ranks (SyncBatchNorm); ddp/fsdp only")
    reshard_after_forward: bool = opt(True, "fsdp: free each block's gathered parameters after its forward (false: keep "
                                            "them until the backward, more memory, one all-gather less per step)")
    cpu_offload: bool = opt(False, "fsdp: keep parameters, gradients and optimizer state on the CPU (the optimizer "
                                   "steps there); for a model that does not fit on the devices otherwise")


# the parallel dimensions, outermost first (torchtitan's order: consecutive ranks differ in tp, so a
# tensor-parallel group stays within a node); runner/engine/parallel/mesh.py lays the ranks out by it
PARALLEL_DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
NOT_AVAILABLE_YET = {"tp": "tensor", "pp": "pipeline", "cp": "context"}  # the next issue builds them


def check_degrees(par: ParallelismSpec) -> None:
    """What can be said of the degrees before the number of processes is known."""
    for name in PARALLEL_DIMENSIONS:
        degree = getattr(par, name)
        if degree == 0 or degree < -1:
            raise SpecError(f"parallelism.{name}: {degree} is not a degree; allowed: a positive number of processes, "
                            "or -1 for the processes the other degrees leave")
    for name, kind in NOT_AVAILABLE_YET.items():
        if getattr(par, name) != 1:
            raise SpecError(f"parallelism.{name}: {getattr(par, name)}; tensor/pipeline/context parallelism is not "
                            f"available yet ({kind} parallelism: keep {name}=1)")
    rest = [name for name in PARALLEL_DIMENSIONS if getattr(par, name) == -1]
    if len(rest) > 1:
        raise SpecError(f"parallelism.{rest[1]}: -1, but parallelism.{rest[0]} is -1 already; at most one degree "
                        "takes the processes left")


@dataclass(frozen=True)
class AccumulationSpec:
    steps: int = opt(1, "micro-batches per optimizer step (shorthand: +accum=N)", gt=0)


@dataclass(frozen=True)
class EarlyStoppingSpec:
    monitor: Optional[str] = opt(None, "metric to watch, e.g. val/loss; null turns early stopping off")
    mode: Optional[Literal["min", "max"]] = opt(None, "whether the monitored metric should fall or rise; null: "
                                                     "the direction the task declares for it")
    patience: int = opt(5, "evaluations without improvement before stopping", gt=0)
    min_delta: float = opt(0.0, "smallest change that counts as improvement", ge=0)


@dataclass(frozen=True)
class CallbackSpec(Component):
    """A user's own engine add-on (Lightning users call these callbacks): a class named by `_target_`,
    subclassing runner.addons.base.AddOn, and its own arguments, checked against its signature."""

    target: str = ""
    params: dict = field(default_factory=dict)

    def __to_plain__(self) -> dict:
        return {"_target_": self.target, **self.params}

    @classmethod
    def parse(cls, data: Any, key: str) -> "CallbackSpec":
        data = component_dict(data, key)
        return cls(target=data.pop("_target_"), params=data)


@dataclass(frozen=True)
class TrainerSpec(DebugKeys):  # the debugging keys: runner/spec/debug.py
    max_epochs: int = opt(20, "epochs to train", gt=0)
    max_steps: Optional[int] = opt(None, "optimizer steps to train; wins over max_epochs when set", gt=0)
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "device: auto picks cuda when available")
    eval_every_n_steps: int = opt(0, "evaluate every N optimizer steps (0: off)", ge=0)
    eval_every_epoch: bool = opt(True, "evaluate at the end of every epoch")
    clip_grad_norm: Optional[float] = opt(None, "clip the global gradient norm to this value", gt=0)
    clip_grad_value: Optional[float] = opt(None, "clip each gradient element to +-value", gt=0)
    log_every_n_steps: int = opt(10, "log training metrics every N optimizer steps", gt=0)
    checkpoint_every_n_steps: int = opt(0, "write a checkpoint every N optimizer steps (0: only at the end)", ge=0)
    keep_checkpoints: int = opt(2, "step checkpoints kept on disk (the newest)", gt=0)
    resume: Optional[str] = opt(None, "checkpoint file or run directory to resume from; latest: the newest run under outputs/runs")
    stop_at_step: Optional[int] = opt(None, "pause at this optimizer step: validate, write its checkpoint and stop without "
                                            "the final test; the schedule still plans the whole run (population-based "
                                            "training's rounds); a resume goes on", gt=0)
    test_on: Literal["best", "last"] = opt("best", "test the weights of objective.metric's best validation (kept as checkpoints/best-step-N.pt), or the last")
    progress_bar: Literal["auto", "on", "off"] = opt("auto", "auto: only when stderr is a terminal")
    compile: Literal[False, True, "default", "reduce-overhead", "max-autotune"] = opt(
        False, "torch.compile the model in this mode (true: default); runner/engine/compiling.py")
    peak_tflops: Optional[float] = opt(None, "peak TFLOP/s of one device at this precision, for MFU; null: from the "
                                             "table of known GPUs (runner/engine/flops.py), none on a CPU", gt=0)
    profile: bool = opt(False, "profile a window of training steps: trace, step-time shares and advice (runner/addons/profiling.py)")
    profile_skip_steps: int = opt(5, "trainer.profile: steps left out before the window (warm-up, compilation)", ge=0)
    profile_steps: int = opt(10, "trainer.profile: optimizer steps in the profiled window", gt=0)
    activation_checkpointing: Literal["none", "full", "selective"] = opt(
        "none", "recompute the activations of the model's repeated blocks in the backward pass: full keeps only "
                "each block's input, selective also keeps its matmul/attention outputs (runner/engine/activation_checkpointing.py)")
    memory_estimate: bool = opt(True, "before training, log per device the memory of parameters, gradients, optimizer "
                                      "state and one measured micro-step's activations against what the device has")
    channels_last: bool = opt(False, "keep 4-D weights (convolutions) channels-last: faster convolutions under bf16/fp16 on a GPU")
    deterministic: bool = opt(False, "use deterministic algorithms (slower)")
    max_non_finite_steps: int = opt(3, "stop the run after this many consecutive optimizer steps with a non-finite "
                                       "loss (fp16 skips them through its loss scaler); 1 stops at the first", gt=0)
    early_stopping: EarlyStoppingSpec = field(default_factory=EarlyStoppingSpec)
    ema: EmaSpec = field(default_factory=EmaSpec)
    swa: SwaSpec = field(default_factory=SwaSpec)
    cross_validation: CrossValidationSpec = field(default_factory=CrossValidationSpec)
    callbacks: tuple[CallbackSpec, ...] = opt((), "a user's own add-ons, each {_target_: my_pkg.MyCallback, ...its "
                                                  "arguments}: a subclass of runner.addons.base.AddOn")


@dataclass(frozen=True)
class TrackingSpec:
    name: str = opt("mlflow", "tracking option (conf/tracking/<name>.yaml): mlflow, or none for no tracking at all")
    uri: str = opt("sqlite:///outputs/mlflow.db", "MLflow tracking URI")
    experiment: str = opt("runner", "MLflow experiment name")
    artifact_root: str = opt("outputs/mlartifacts", "artifact location for new experiments on a local store")
    run_name: Optional[str] = opt(None, "MLflow run name; default: built from the overrides")
    log_model: Literal["best", "last", "none"] = opt(
        "none", "log the model as an MLflow model (mlflow.pytorch) at the end: best (the weights the test used), "
                "last, or none (runner/addons/mlflow_model.py)")


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
class TuneSpec:
    """A finder that runs before training (conf/tune/<name>.yaml, runner/tune/): `tune=lr_find` sweeps the
    learning rate, `tune=batch_size` the micro-batch. It prints what it found and the override to use;
    with `apply` the run then trains with it. The keys of the finder not chosen keep their defaults."""

    name: Optional[Literal["lr_find", "batch_size"]] = opt(None, "the finder to run before training; null: none")
    apply: bool = opt(False, "train with what the finder found (false: find, report and stop)")
    # lr_find
    min_lr: float = opt(1e-7, "lr_find: the sweep's first learning rate", gt=0)
    max_lr: float = opt(10.0, "lr_find: the sweep's last learning rate (if the loss has not diverged before)", gt=0)
    steps: int = opt(200, "lr_find: optimizer steps of the sweep (the data repeats when an epoch is shorter)",
                     ge=10, le=100_000)
    smoothing: float = opt(0.9, "lr_find: the loss's exponential moving average factor (0: no smoothing)", ge=0, lt=1)
    diverge_factor: float = opt(4.0, "lr_find: the sweep stops once the smoothed loss exceeds this x its best", gt=1)
    # batch_size
    max_batch_size: int = opt(4096, "batch_size: the largest micro-batch tried (and never more than a rank's "
                                    "share of the training split)", ge=2, le=2**20)
    steps_per_candidate: int = opt(3, "batch_size: timed optimizer steps per candidate, after one untimed", gt=0, le=1000)
    knee_tolerance: float = opt(0.05, "batch_size: the knee is the smallest batch within this fraction of the "
                                      "best throughput", ge=0, lt=1)
    pick: Literal["knee", "largest"] = opt("knee", "batch_size: the answer: the throughput knee, or the largest "
                                                   "micro-batch that fits")
    keep_global_batch: bool = opt(False, "batch_size: change accumulation.steps so batch x accumulation x ranks "
                                         "stays as it is (the optimisation is unchanged)")

    def __to_plain__(self) -> dict:
        """Only the chosen finder's keys (spec.yaml, MLflow params)."""
        own = {"name": self.name} if self.name is None else {"name": self.name, "apply": self.apply}
        keys = _TUNE_KEYS.get(self.name or "", ())
        return {**own, **{k: getattr(self, k) for k in keys}}


_TUNE_KEYS = {"lr_find": ("min_lr", "max_lr", "steps", "smoothing", "diverge_factor"),
              "batch_size": ("max_batch_size", "steps_per_candidate", "knee_tolerance", "pick", "keep_global_batch")}


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
            _check_accum_shorthand(accum, cfg, overrides)
            cfg["accumulation"] = {**(cfg.get("accumulation") or {}), "steps": accum}
        cfg["overrides"] = list(overrides)
        spec = _build(cls, _with_components(cfg), "")
        spec.validate()
        return spec

    @classmethod
    def from_yaml(cls, text: str) -> "RunSpec":
        spec = _build(cls, _with_components(yaml.safe_load(text) or {}), "")
        spec.validate()
        return spec

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values, for MLflow params."""
        return flat_keys(self.to_dict())

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    # --- cross-field rules --------------------------------------------------------------------

    def validate(self) -> None:
        for group in OPTION_GROUPS:
            check_option(group, getattr(self, group).name, f"{group}.name")
        if self.trainer.clip_grad_norm is not None and self.trainer.clip_grad_value is not None:
            raise SpecError("trainer.clip_grad_value: set either clip_grad_norm or clip_grad_value, not both")
        par = self.parallelism
        check_degrees(par)
        if par.name == "single" and (par.nnodes > 1 or par.nproc_per_node > 1):
            key, value = ("nnodes", par.nnodes) if par.nnodes > 1 else ("nproc_per_node", par.nproc_per_node)
            raise SpecError(f"parallelism.{key}: {value} needs several processes but parallelism=single runs one; "
                            "add parallelism=ddp or parallelism=fsdp")
        if par.sync_batchnorm and par.name == "single":
            raise SpecError("parallelism.sync_batchnorm: true needs several processes but parallelism=single runs one "
                            "(its BatchNorm already sees the whole batch); add parallelism=ddp or parallelism=fsdp")
        split = [(k, getattr(par, k)) for k in PARALLEL_DIMENSIONS if getattr(par, k) > 1]
        if par.name == "single" and split:
            raise SpecError(f"parallelism.{split[0][0]}: {split[0][1]} needs several processes but parallelism=single "
                            "runs one; add parallelism=ddp, fsdp or hsdp")
        fsdp_only = [(k, v) for k, v, default in (("reshard_after_forward", par.reshard_after_forward, True),
                                                  ("cpu_offload", par.cpu_offload, False)) if v != default]
        if fsdp_only and par.dp_shard == 1:  # options of a sharded wrap: fsdp, hsdp
            key, value = fsdp_only[0]
            raise SpecError(f"parallelism.{key}: {str(value).lower()} is an fsdp option, but parallelism={par.name}; "
                            "use parallelism=fsdp or drop it")
        if par.node_rank >= par.nnodes:
            raise SpecError(f"parallelism.node_rank: {par.node_rank} is out of range; allowed: 0 to nnodes-1 ({par.nnodes - 1})")
        host, _, port = par.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise SpecError(f"parallelism.rdzv_endpoint: {par.rdzv_endpoint!r} is not host:port; e.g. 10.0.0.1:29400")
        check_averaging(self.trainer)
        check_cross_validation(self)
        if fraction(self, "val") + fraction(self, "test") >= 1:
            raise SpecError("dataset.val_fraction: val_fraction + test_fraction must be < 1")
        check_metric_names(self)
        check_mode(self)
        if self.tune.name == "lr_find" and self.tune.min_lr >= self.tune.max_lr:
            raise SpecError(f"tune.min_lr: {self.tune.min_lr:g} is not below tune.max_lr ({self.tune.max_lr:g}); "
                            "the sweep rises from min_lr to max_lr, e.g. tune.min_lr=1e-7 tune.max_lr=10")


# --- config-group options and metric names: each rule once, used by the CLI and the spec ---------

# the groups whose chosen option is the spec's `<group>.name`; the others are components named by
# `_target_` (their options may also come from a user's hydra.searchpath: Hydra checks those)
OPTION_GROUPS = ("precision", "parallelism", "tracking")
COMPONENT_GROUPS = ("model", "dataset", "task", "optimizer", "scheduler")


def check_option(group: str, value: Any, key: str | None = None, searchpath: tuple[str, ...] = ()) -> None:
    """Refuse an option of a config group that has no <group>/<value>.yaml in conf/ or on the search path."""
    from runner.cli import registry  # late: the registry lists conf/, which only this check needs

    allowed = registry.options(group, searchpath)
    if value not in allowed:
        raise SpecError(f"{key or group}: unknown option {value!r}; {did_you_mean(str(value), allowed)}"
                        f"choose one of {', '.join(allowed)}")


def _with_components(cfg: dict) -> dict:
    """The component nodes parsed as components (their keys belong to their _target_)."""
    cfg = dict(cfg)
    for group, spec_class in _COMPONENTS.items():
        if group in cfg:
            cfg[group] = spec_class.parse(cfg[group])
    trainer = cfg.get("trainer")
    if isinstance(trainer, dict) and isinstance(trainer.get("callbacks"), (list, tuple)):
        cfg["trainer"] = {**trainer, "callbacks": [CallbackSpec.parse(c, f"trainer.callbacks[{i}]")
                                                   for i, c in enumerate(trainer["callbacks"])]}
    return cfg


_COMPONENTS = {"model": ModelSpec, "dataset": DatasetSpec, "task": TaskSpec, "optimizer": OptimizerSpec,
               "scheduler": SchedulerSpec}


def _check_accum_shorthand(accum: Any, cfg: dict, overrides: tuple[str, ...]) -> None:
    explicit = [o for o in overrides if o.lstrip("+~").startswith("accumulation.steps=")]
    if explicit:
        steps = (cfg.get("accumulation") or {}).get("steps")
        if steps != accum:
            raise SpecError(f"accum: +accum={accum} conflicts with accumulation.steps={steps}; set only one")
