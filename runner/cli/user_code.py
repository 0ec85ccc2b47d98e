"""Which of the user's own components a failure came from: a model, dataset, task or callback named by
`_target_` whose code raised. Such a failure is the user's program, not runner's, and is said in one line
naming the key and the line of their code that raised; the whole traceback goes to the run directory's
error.txt (MLflow's error.txt artifact holds it too)."""
from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path
from types import TracebackType

from runner.specs.run import RunSpec


def _module_file(target: str) -> Path | None:
    """The source file of the module a dotted `_target_` lives in (its longest importable prefix)."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.util.find_spec(".".join(parts[:i]))
        except (ImportError, ValueError):
            continue
        if found is not None and found.origin and found.origin.endswith(".py"):
            return Path(found.origin).resolve()
    return None


def _components(spec: RunSpec) -> dict[Path, tuple[str, str]]:
    """Source file -> (the key, the target) for every component the spec names by `_target_`."""
    named = [("model", spec.model.target), ("dataset", spec.dataset.target), ("task", spec.task.target),
             *((f"trainer.callbacks[{i}]", c.target) for i, c in enumerate(spec.trainer.callbacks))]
    files = {}
    for key, target in named:
        path = _module_file(target) if target else None
        if path is not None and path not in files:
            files[path] = (key, target)
    return files


def user_failure(error: BaseException, spec: RunSpec) -> str | None:
    """One line for a failure raised in a component's own code (its innermost frame of theirs), with the full
    traceback written to <run_dir>/error.txt; None when the failure came from elsewhere."""
    files = _components(spec)
    frames = traceback.extract_tb(error.__traceback__ if isinstance(error.__traceback__, TracebackType) else None)
    for frame in reversed(frames):  # innermost first: the line of theirs closest to the raise
        found = files.get(Path(frame.filename).resolve())
        if found is None:
            continue
        key, target = found
        where = Path(spec.run_dir) / "error.txt"
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text("".join(traceback.format_exception(error)))
            told = f"; the traceback is in {where}"
        except OSError:
            told = ""
        reason = (str(error).strip().splitlines() or [""])[0][:300]
        return (f"{key}: {target} raised {type(error).__name__}: {reason} (at {frame.filename}:{frame.lineno}, "
                f"in {frame.name}){told}")
    return None
