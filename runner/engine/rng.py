"""The random-number streams: seeded at the start of a run, saved by a checkpoint and restored by a
resume (torch, Python, NumPy, CUDA), kept as tensors and plain values so that checkpoints load with
weights_only=True."""
from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses determinism without it
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


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
