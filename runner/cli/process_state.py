"""Each job starts from the process state of a fresh `python -m runner`.

A grid multirun, or a sweep with one slot, runs its jobs one after another in one process. What a job
sets process-wide (TF32 and determinism flags, thread counts, environment variables, logger levels)
would otherwise carry into the next: after a `precision=tf32` job every later `fp32` job would run
with TF32 on. `isolated()` snapshots that state before a job and puts it back after.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from typing import Any, Iterator

import torch


def snapshot() -> dict[str, Any]:
    loggers = {name: logger.level for name, logger in list(logging.root.manager.loggerDict.items())
               if isinstance(logger, logging.Logger)}
    return {
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": str(torch.get_default_dtype()),
        "num_threads": torch.get_num_threads(),
        "environ": dict(os.environ),
        "root_log_level": logging.root.level,
        "log_levels": loggers,
    }


def restore(state: dict[str, Any]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = state["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = state["cudnn_allow_tf32"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.use_deterministic_algorithms(state["deterministic_algorithms"], warn_only=state["deterministic_warn_only"])
    torch.set_float32_matmul_precision(state["float32_matmul_precision"])
    torch.set_default_dtype(getattr(torch, state["default_dtype"].removeprefix("torch.")))
    if torch.get_num_threads() != state["num_threads"]:
        torch.set_num_threads(state["num_threads"])
    os.environ.clear()
    os.environ.update(state["environ"])
    logging.root.setLevel(state["root_log_level"])
    # Only the loggers that were there before the job: one made during it keeps the level its library gave it
    # on import, as in a fresh process that imported the same library (the module stays imported, so nothing
    # would set it again). NOTSET undid SQLAlchemy's own WARNING, and under runner's INFO root a joblib
    # worker's next trial printed every statement of its study's sqlite storage. A copy: the tracking store
    # opens on another thread, whose libraries make loggers meanwhile.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name in state["log_levels"]:
            logger.setLevel(state["log_levels"][name])


def describe(state: dict[str, Any]) -> dict[str, Any]:
    """The snapshot as a run records it: environment values are hashed (they may hold secrets)."""
    out = {k: v for k, v in state.items() if k not in ("environ", "log_levels")}
    out["environ_sha256"] = {k: hashlib.sha256(v.encode()).hexdigest()[:12] for k, v in sorted(state["environ"].items())}
    out["log_levels"] = {k: v for k, v in sorted(state["log_levels"].items()) if v != logging.NOTSET}
    return out


@contextlib.contextmanager
def isolated() -> Iterator[dict[str, Any]]:
    """The job runs inside; whatever it set process-wide is undone when it ends, however it ends."""
    state = snapshot()
    try:
        yield state
    finally:
        restore(state)
