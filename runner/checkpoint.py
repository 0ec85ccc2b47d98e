"""Checkpoints: everything a run needs to continue as if never stopped, written atomically.

A checkpoint is one torch file holding model, optimizer, scheduler, precision (scaler) state, RNG
states, step/epoch and the data position. It is written to a temporary file in the same directory,
fsynced and renamed, so a crash leaves the previous checkpoint intact, never a torn one. It is
loaded with `weights_only=True`: everything in it is tensors and plain containers.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.spec import SpecError

LAST = "last.pt"
_STEP_FILE = re.compile(r"step-(\d+)\.pt$")


def save(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write step-<step>.pt atomically, point last.pt at it, drop all but the newest `keep`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:08d}.pt"
    _atomic_save(state, path)
    _atomic_link(path, directory / LAST)
    for old in sorted(directory.glob("step-*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load(path_or_run_dir: str | Path) -> dict[str, Any]:
    path = resolve(path_or_run_dir)
    return torch.load(path, map_location="cpu", weights_only=True)


def resolve(path_or_run_dir: str | Path) -> Path:
    """A checkpoint file, or a run directory (its checkpoints/last.pt, else the newest step file)."""
    path = Path(path_or_run_dir)
    if path.is_dir():
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        candidates = [directory / LAST] if (directory / LAST).exists() else sorted(directory.glob("step-*.pt"))
        if candidates:
            return candidates[-1]
        raise SpecError(f"trainer.resume: no checkpoint in {path}; give a checkpoint file or a run directory holding checkpoints/")
    if not path.is_file():
        raise SpecError(f"trainer.resume: {str(path)!r} does not exist; give a checkpoint file or a run directory")
    return path


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": _python_rng(), "numpy": _numpy_rng()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal.tolist()), None if gauss is None else float(gauss)))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# weights_only loading accepts tensors and plain containers, so the RNG states are stored as tensors


def _python_rng() -> tuple:
    version, internal, gauss = random.getstate()
    return version, torch.tensor(internal, dtype=torch.int64), gauss


def _numpy_rng() -> tuple:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_link(target: Path, link: Path) -> None:
    """last.pt is a hard link to the newest step file: no second copy on disk, replaced atomically."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError:  # file systems without hard links
        _atomic_save(torch.load(target, weights_only=True), link)
        return
    os.replace(tmp, link)


def read_spec(path_or_run_dir: str | Path) -> str | None:
    """The spec YAML a checkpoint holds (None for checkpoints written before they held one)."""
    return load(path_or_run_dir).get("spec")
