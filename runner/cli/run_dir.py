"""The run directory: checked writable before a run starts, and shared by every rank under torchrun."""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from runner.specs.fields import SpecError

_REASONS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
            errno.EACCES: "permission denied", errno.EPERM: "not permitted",
            errno.ENOENT: "directories cannot be created there"}


def check_writable(key: str, path: str) -> None:
    """Create the run directory and write a file into it, then remove them again (Hydra makes the
    directory itself moments later): a directory that cannot be written fails here, in one line,
    rather than inside Hydra's, the engine's or MLflow's setup, and nothing is left behind.

    On success only the run directory itself is removed: its parents (outputs/runs/<date>) may be
    shared with a run starting beside this one, and Hydra needs them anyway."""
    target = Path(path).absolute()
    missing = [d for d in [target, *target.parents] if not d.exists()]  # deepest first
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".runner-write-check-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 65536)  # a few blocks: a disk with a few bytes left still fails
                f.flush()
                os.fsync(f.fileno())  # delayed allocation reports a full disk only here
        finally:
            probe.unlink(missing_ok=True)
    except OSError as e:
        _remove_empty(missing)
        raise SpecError(f"{key}: cannot write the run directory {target} ({_reason(e, target)}); "
                        f"choose another with {key}=<dir>") from None
    _remove_empty(missing[:1] if missing and missing[0] == target else [])


def _remove_empty(directories: list[Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (another run's), or never made
            pass


def _reason(error: OSError, target: Path) -> str:
    if error.errno == errno.ENOTDIR:
        blocker = next((p for p in [target, *target.parents] if p.is_file()), None)
        return f"{blocker} is a file, not a directory" if blocker else "not a directory"
    return _REASONS.get(error.errno or 0, error.strerror or str(error))


def under_torchrun() -> bool:
    # runner.engine.parallel.in_torchrun says the same, but importing it imports torch
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def shared_run_dir_overrides(run_dir: str | None) -> list[str]:
    """Under torchrun every rank runs this command and Hydra would give each its own run directory;
    rank 0's (the user's hydra.run.dir, or the default with rank 0's time) is the one all ranks use, and
    only rank 0 writes Hydra's files and logs."""
    import datetime

    import torch

    from runner.engine.parallel import broadcast_object, init_process_group

    env = init_process_group("cuda" if torch.cuda.is_available() else "cpu")
    now = datetime.datetime.now()
    shared = broadcast_object(run_dir or f"outputs/runs/{now:%Y-%m-%d}/{now:%H-%M-%S-%f}")
    extra = [f"hydra.run.dir={_override_value(shared)}"]
    if env.rank != 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    return extra


def _override_value(text: str) -> str:
    """A path as one override value: quoted where Hydra's grammar would read it otherwise (a comma: a sweep)."""
    if re.fullmatch(r"[\w./:-]+", text):
        return text
    return "'" + text.replace("'", "\\'") + "'"  # Hydra keeps other backslashes in a quoted value as they are


RUNS = Path("outputs/runs")  # where hydra.run.dir puts runs by default (conf/config.yaml)


def latest_run(root: Path = RUNS) -> Path:
    """`trainer.resume=latest`: the training run directory under `root` written to last (mode=eval, predict and
    export runs are not runs to continue), by the modification time of
    its newest checkpoint file, or of its spec.yaml before its first checkpoint. A directory holding
    neither (Hydra's fresh one for this very command) is no run. A k-fold run's folds (`<run>/fold-<k>`)
    are parts of it, not runs of their own: what they wrote counts for the k-fold run, which resumes
    at its first unfinished fold."""
    import datetime
    import logging

    newest: tuple[float, Path, Path] | None = None
    for spec_file in root.glob("**/spec.yaml") if root.is_dir() else []:
        if not _is_training_run(spec_file):
            continue  # an eval, predict or export run: nothing there to continue training
        run = spec_file.parent
        while re.fullmatch(r"fold-\d+", run.name) and (run.parent / "spec.yaml").is_file():
            run = run.parent
        written = [*(spec_file.parent / "checkpoints").glob("*.pt"), spec_file]
        when, path = max((p.stat().st_mtime, p) for p in written if p.exists())  # a checkpoint is a folder
        if newest is None or when > newest[0]:
            newest = (when, run, path)
    if newest is None:
        raise SpecError(f"trainer.resume: latest finds no training run under {root.absolute()} (no directory there "
                        "holds the spec.yaml of one); give a run directory or a checkpoint file")
    when, run, path = newest[0], newest[1].absolute(), newest[2].absolute()
    logging.getLogger(__name__).info("trainer.resume=latest: %s, the newest run (its %s, written %s)", run,
                                     path.relative_to(run), datetime.datetime.fromtimestamp(when).isoformat(" ", "seconds"))
    return run


def _is_training_run(spec_file: Path) -> bool:
    """Whether spec.yaml is a training run's (mode: train); an unreadable one counts, so resuming it says why."""
    import yaml

    try:
        spec = yaml.safe_load(spec_file.read_text())
    except (OSError, yaml.YAMLError):
        return True
    return not isinstance(spec, dict) or spec.get("mode", "train") == "train"
