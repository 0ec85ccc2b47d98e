"""Resume: `trainer.resume=<run dir | checkpoint>` continues a run from that run's own spec.

Hydra composes today's defaults plus today's overrides; a resumed run must not pick those up for
anything the user did not retype (max_epochs, and with it the schedule, would silently change). So
the spec saved with the run (inside every checkpoint, and as spec.yaml) is the base, and only the
overrides typed with the resume are applied on top, and only where they change how long the run
goes, where it runs, or where it logs. An override that changes what is trained stops the resume
with one line naming the key, the saved value and the new one.

Where the run goes on:
- a run directory: in place. Same run directory, same MLflow run, newest good checkpoint; a run stopped
  before its first checkpoint starts over from its spec.yaml (each step already logged stays logged once).
- a checkpoint file: a new run (this invocation's run directory, a new MLflow run tagged with the
  run it came from), so another run's records are never written into.
"""
from __future__ import annotations

import logging
from pathlib import Path

import yaml

from runner.engine import checkpoint
from runner.engine.parallel import nominal_world, resolve_dims
from runner.specs.fields import set_dotted
from runner.specs.run import COMPONENT_GROUPS, RunSpec, SpecError

log = logging.getLogger(__name__)

# What an override given with a resume may change: how long, where it runs, where it logs.
MAY_CHANGE = ("trainer.max_steps", "trainer.max_epochs", "trainer.device", "trainer.progress_bar",
              "trainer.log_every_n_steps", "trainer.checkpoint_every_n_steps", "trainer.keep_checkpoints",
              "trainer.async_checkpoint", "trainer.resume", "trainer.slurm_requeue", "trainer.stop_at_step", "trainer.test_on", "trainer.compile", "trainer.peak_tflops", "trainer.deterministic", "dataset.num_workers",
              "dataset.root", "dataset.download", "trainer.profile", "parallelism.", "tracking.", "trial.",
              "weights.")  # which weights leave the run (tracking.log_model's average), not what is trained
# These may change only together, keeping the global batch (a checkpoint is portable across strategies).
BATCH_KEYS = ("dataset.batch_size", "accumulation.steps")


def plan(spec: RunSpec) -> RunSpec:
    """The spec a resume runs: the saved spec with the allowed typed overrides of `spec` applied."""
    target = Path(spec.trainer.resume)
    in_place = target.is_dir() and not checkpoint.is_folder(target)  # a run directory, not one checkpoint's folder
    saved = _saved_spec(target)
    typed = typed_keys(spec.overrides)
    new_flat, saved_flat = spec.flat(), saved.flat()
    merged = saved.to_dict()
    for key in sorted(new_flat):
        if not _typed(key, typed) or new_flat[key] == saved_flat.get(key) or key in ("run_dir", "overrides"):
            continue
        if not (key.startswith(MAY_CHANGE) or key in BATCH_KEYS):
            raise SpecError(f"{key}: the resumed run was trained with {saved_flat.get(key)!r}, this resume sets "
                            f"{new_flat[key]!r}; a resume continues the run's own spec and may change only how long it "
                            "trains (trainer.max_steps/max_epochs), where it runs (device, parallelism, data workers) "
                            "and where it logs (tracking.*)")
        set_dotted(merged, key, new_flat[key])
    if not _typed("trainer.stop_at_step", typed):  # a paused run's resume goes on unless it pauses again
        merged["trainer"]["stop_at_step"] = None
    merged["run_dir"] = str(target) if in_place else spec.run_dir
    merged["overrides"] = list(saved.overrides if in_place else spec.overrides)
    merged["trainer"]["resume"] = str(target)
    resumed = RunSpec.from_yaml(yaml.safe_dump(merged))
    _check_global_batch(saved, resumed)
    cv = saved.trainer.cross_validation
    k_fold = cv.folds is not None and cv.fold is None  # its folds hold the checkpoints; it says what they do
    fold = cv.fold if cv.folds is not None else None  # one fold of a k-fold run, resumed by that run
    log.info("%s %s", ("continuing the k-fold run in" if k_fold else f"continuing fold {fold} in" if fold is not None
                       else "continuing the run in") if in_place else "starting a new run from", target)
    if starts_over(target) and not k_fold:  # the engine then loads no checkpoint
        if fold is not None:  # the k-fold run goes on at this fold, the folds before it kept
            log.info("fold %d holds no checkpoint yet: it starts over from its step 0 (the k-fold run goes on at "
                     "fold %d)", fold, fold)
        else:
            log.info("%s holds no checkpoint yet: the run starts over from step 0", target)
    return resumed


def typed_keys(overrides: tuple[str, ...]) -> set[str]:
    """Keys the user typed: `optimizer.lr=0.1` -> optimizer.lr; a group choice `precision=bf16` -> precision.name
    (`optimizer=sgd` -> every key of the component: `optimizer.`); `+accum=4` -> accumulation.steps."""
    keys = set()
    for override in overrides:
        key, sep, _ = override.lstrip("+~").partition("=")
        if not sep or key.startswith("hydra"):
            continue
        if key == "accum":
            key = "accumulation.steps"
        elif "." not in key and key not in ("seed", "run_dir"):
            # a group choice: the option's name, or for components and whole-group moves every key
            key = key + "." if key in ("parallelism", "tracking", *COMPONENT_GROUPS) else f"{key}.name"
        keys.add(key)
    return keys


def _typed(key: str, typed: set[str]) -> bool:
    return key in typed or any(t.endswith(".") and key.startswith(t) for t in typed)


def check_source(target: str | Path, training: bool = True) -> None:
    """What `trainer.resume` names, checked without loading anything: one line when it cannot be resumed
    (training: a file of a run's weights alone, such as its best-step-N.pt, holds nothing to train on from)."""
    if not starts_over(Path(target)):
        path, kind = checkpoint.verify_kind(target)
        if training:
            _refuse_weights_only(path, kind)


def _refuse_weights_only(path: Path, kind: str) -> None:
    if kind == checkpoint.WEIGHTS:
        raise SpecError(f"trainer.resume: {path} holds a run's weights only, not its training state; train from "
                        f"them with model.weights={path}, or evaluate them with mode=eval")


def starts_over(target: Path) -> bool:
    """A run directory whose run was stopped before its first checkpoint: its resume starts it over in
    place (its spec.yaml, its MLflow run), rather than leaving it unresumable."""
    return (target.is_dir() and not checkpoint.is_folder(target) and not checkpoint.has_checkpoint(target)
            and (target / "spec.yaml").is_file())


def _saved_spec(target: Path) -> RunSpec:
    if starts_over(target):
        return RunSpec.from_yaml((target / "spec.yaml").read_text())
    path, kind = checkpoint.verify_kind(target)
    _refuse_weights_only(path, kind)  # a resume trains on from the file: a best-step-N.pt cannot be one
    text = checkpoint.read_spec(path)
    if text is None:  # a checkpoint written before checkpoints held their spec: the run's spec.yaml
        spec_file = path.parent.parent / "spec.yaml"
        if not spec_file.is_file():
            raise SpecError(f"trainer.resume: {path} holds no run spec and no spec.yaml lies beside its run directory")
        text = spec_file.read_text()
    return RunSpec.from_yaml(text)


def _dp_degree(spec: RunSpec) -> int:
    return resolve_dims(spec.parallelism, nominal_world(spec.parallelism)).dp


def _check_global_batch(saved: RunSpec, resumed: RunSpec) -> None:
    def global_batch(s: RunSpec) -> int:
        return s.dataset.batch_size * s.accumulation.steps * _dp_degree(s)

    if global_batch(saved) != global_batch(resumed):
        raise SpecError(f"parallelism: the resumed run was trained with a global batch of {global_batch(saved)} "
                        f"(dataset.batch_size x accumulation.steps x ranks), this resume gives {global_batch(resumed)}; "
                        "keep it by adjusting dataset.batch_size or +accum together with the number of ranks")
