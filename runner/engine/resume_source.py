"""What `trainer.resume` names, read: a run directory or a checkpoint, checked (one line when it cannot be
resumed) and the spec saved with it read back. Which of that spec's keys a resume may change is the
spec's rule (runner/specs/resume.py); this module reads the checkpoints it applies to (runner/engine/checkpoint.py)."""
from __future__ import annotations

import logging
from pathlib import Path

from runner.engine import checkpoint
from runner.specs import resume
from runner.specs.run import RunSpec, SpecError

log = logging.getLogger(__name__)


def plan(spec: RunSpec) -> RunSpec:
    """The spec a resume runs: the saved spec with the allowed typed overrides of `spec` applied."""
    target = Path(spec.trainer.resume)
    in_place = target.is_dir() and not checkpoint.is_folder(target)  # a run directory, not one checkpoint's folder
    saved = _saved_spec(target)
    resumed = resume.resumed_spec(spec, saved, target, in_place)
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
