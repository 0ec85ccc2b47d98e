"""The trainer group (conf/trainer/default.yaml, and the presets of conf/debug/ that set its debugging keys):
how long and how a run trains, evaluates, checkpoints and tests, with its nested keys: early stopping,
weight averaging (EMA, SWA) and k-fold cross-validation. runner/engine/ acts on them; the debugging keys
are runner/engine/debugging.py's, the averaging keys runner/addons/averaging.py's, the k-fold keys
runner/search/cross_validation.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from runner.specs.fields import Component, SpecError, opt


@dataclass(frozen=True)
class EarlyStoppingSpec:
    monitor: Optional[str] = opt(None, "metric to watch, e.g. val/loss; null turns early stopping off")
    mode: Optional[Literal["min", "max"]] = opt(None, "whether the monitored metric should fall or rise; null: "
                                                     "the direction the task declares for it")
    patience: int = opt(5, "evaluations without improvement before stopping", gt=0)
    min_delta: float = opt(0.0, "smallest change that counts as improvement", ge=0)


@dataclass(frozen=True)
class EmaSpec:
    """An exponential moving average of the weights (runner/addons/averaging.py), evaluated as val/ema/*."""

    decay: Optional[float] = opt(None, "EMA_t = decay_t * EMA_(t-1) + (1 - decay_t) * weights_t after every optimizer "
                                       "step t, EMA_0 = the starting weights; e.g. 0.999; null: off", gt=0, lt=1)
    warmup: bool = opt(False, "decay_t = min(decay, (1 + t) / (10 + t)): early steps weigh more while the EMA would "
                              "still be mostly the random start")


@dataclass(frozen=True)
class SwaSpec:
    """Stochastic weight averaging (runner/addons/averaging.py): the mean of the weights at the ends of the last
    epochs, evaluated as val/swa/*; BatchNorm statistics recomputed for it at the end of training."""

    start_epoch: Optional[int] = opt(None, "average the weights at the end of this epoch (counted from 0) and of "
                                           "every later one; null: off", ge=0)
    lr: Optional[float] = opt(None, "from start_epoch on, anneal the lr to this value and hold it (torch SWALR); "
                                    "null: the run's own schedule goes on", gt=0)
    anneal_epochs: int = opt(1, "epochs the lr takes to reach swa.lr (cosine); 0: at once", ge=0)


@dataclass(frozen=True)
class CrossValidationSpec:
    """K-fold cross-validation: K runs, fold k validating on the k-th of K parts of train+val and training
    on the rest; the test split is the same for every fold. The run's objective is the folds' mean."""

    folds: Optional[int] = opt(None, "K: train K runs over the folds of train+val (stratified by class for "
                                     "classification) and return the mean objective; null: one ordinary run", ge=2)
    seed: int = opt(0, "the fold seed: which samples fall in which fold (the same seed gives the same folds, "
                       "whatever the run's seed)", ge=0, lt=2**32)
    fold: Optional[int] = opt(None, "train this fold only (0 to folds-1); runner sets it for each fold's run", ge=0)
    parent_run: Optional[str] = opt(None, "the MLflow run of the K-fold run a fold's run logs under (runner sets it)")


CALLBACKS_TAKE = ("a list of add-ons, each {_target_: my_pkg.MyCallback, ...its arguments} (a subclass of "
                  "runner.addons.base.AddOn), e.g. trainer.callbacks=[{_target_: my_pkg.MyCallback}]")


def callbacks_refusal(value: Any) -> str:
    """One line for a trainer.callbacks that is no list (a mapping, a number): what the key takes."""
    shown = value if isinstance(value, str) else repr(value)  # as typed
    return f"trainer.callbacks: {shown} is not a list; give {CALLBACKS_TAKE}"


@dataclass(frozen=True)
class CallbackSpec(Component):
    """A user's own engine add-on (Lightning users call these callbacks): a class named by `_target_`,
    subclassing runner.addons.base.AddOn, and its own arguments, checked against its signature."""

    target: str = ""
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerSpec:
    # debugging (conf/debug/<preset>.yaml sets them; runner/engine/debugging.py acts on them)
    limit_train: float = opt(1.0, "train on this fraction of the training split: its first samples, taken before "
                                  "they are dealt to ranks (every rank and a resumed run see the same ones)", gt=0, le=1)
    limit_val: float = opt(1.0, "validate on this fraction of the validation split (its first samples)", gt=0, le=1)
    limit_test: float = opt(1.0, "test on this fraction of the test split (its first samples)", gt=0, le=1)
    max_eval_batches: Optional[int] = opt(None, "validate and test on at most this many global batches (the first "
                                                "samples of each split); null: the whole (limited) split", gt=0)
    overfit_batches: int = opt(0, "train on the first N global batches of the training split only, repeated until the "
                                  "training loss is below overfit_target_loss (0: off)", ge=0)
    overfit_target_loss: float = opt(0.01, "overfit_batches: stop once every batch's training loss of one pass over "
                                           "them is below this", gt=0)
    save_checkpoints: bool = opt(True, "write checkpoints (false: none, not even the final one)")
    detect_anomaly: bool = opt(False, "torch.autograd anomaly detection for the run: the first backward producing "
                                      "NaN stops the run naming the step (slow)")
    check_finite_every_step: bool = opt(False, "check that the loss is finite after every optimizer step (a device "
                                               "sync per step) instead of on log steps")
    # the run
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
    async_checkpoint: bool = opt(False, "write each checkpoint's shards in a background thread while training goes on "
                                 "(torch.distributed.checkpoint.async_save); it is committed (manifest, last.pt) when the next "
                                 "one starts or the run ends, so a kill meanwhile leaves the previous checkpoint the newest")
    resume: Optional[str] = opt(None, "checkpoint file or run directory to resume from; latest: the newest run under outputs/runs")
    slurm_requeue: bool = opt(True, "inside a SLURM job (SLURM_JOB_ID set), a run stopped by SIGTERM/SIGHUP requeues its "
                                    "own job (scontrol requeue) after writing that step's checkpoint: the job comes back "
                                    "and continues from it; false: the job ends there (runner/engine/preemption.py)")
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


def check_trainer(trainer: TrainerSpec) -> None:
    """RunSpec.validate's rules across the trainer's keys and the run's length."""
    if trainer.clip_grad_norm is not None and trainer.clip_grad_value is not None:
        raise SpecError("trainer.clip_grad_value: set either clip_grad_norm or clip_grad_value, not both")
    ema, swa = trainer.ema, trainer.swa
    if ema.warmup and ema.decay is None:
        raise SpecError("trainer.ema.warmup: true needs trainer.ema.decay (the EMA it warms up); set e.g. "
                        "trainer.ema.decay=0.999, or drop it")
    if swa.lr is not None and swa.start_epoch is None:
        raise SpecError(f"trainer.swa.lr: {swa.lr:g} needs trainer.swa.start_epoch (the epoch SWA starts); set it too, "
                        "or drop it")
    if swa.start_epoch is not None and trainer.max_steps is None and swa.start_epoch >= trainer.max_epochs:
        raise SpecError(f"trainer.swa.start_epoch: {swa.start_epoch} is never reached (trainer.max_epochs={trainer.max_epochs}"
                        f" ends with epoch {trainer.max_epochs - 1}); allowed: 0 to {trainer.max_epochs - 1}")


def check_cross_validation(spec) -> None:
    """RunSpec.validate's rules for the k-fold keys (spec: a RunSpec; they concern its dataset and mode too)."""
    cv = spec.trainer.cross_validation
    if cv.folds is None:
        if cv.fold is not None:
            raise SpecError(f"trainer.cross_validation.fold: {cv.fold} needs trainer.cross_validation.folds (how many "
                            "folds there are); set e.g. trainer.cross_validation.folds=5, or drop it")
        return
    if cv.fold is not None and cv.fold >= cv.folds:
        raise SpecError(f"trainer.cross_validation.fold: {cv.fold} is out of range; allowed: 0 to {cv.folds - 1} "
                        f"(trainer.cross_validation.folds={cv.folds})")
    if "val_fraction" in spec.dataset.params and spec.dataset.fraction("val") == 0:
        raise SpecError(f"trainer.cross_validation.folds: {cv.folds} folds train+val, but dataset.val_fraction=0 "
                        "leaves no validation split; set dataset.val_fraction > 0 (e.g. 0.15): train and val are "
                        "merged, then each fold validates on 1/K of them")
    if spec.mode != "train" and cv.fold is None:
        raise SpecError(f"trainer.cross_validation.folds: {cv.folds} trains K runs, so mode={spec.mode} has no one "
                        "model to use; name one fold's run directory (<run dir>/fold-<k>) in trainer.resume")
