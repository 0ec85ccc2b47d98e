"""The seed checkpoint: a sharded run's initial values, equal to one process's, with no rank holding the whole model.

Where the run shards the model (parallelism.meta_init, parallel/parallelize.py), every rank builds it on the meta
device and cuts, splits and shards it there; only this rank's shards are then materialised, and their values come
from here. The whole model is built exactly as one process builds it (from the RNG state the ranks reached, its
weights loaded and its parameters frozen, on the CPU) by a short-lived process that each node's local rank 0
starts while the node's other ranks wait, and written with torch.distributed.checkpoint into a folder under the
run directory (each node its own: no shared disk is assumed). Each rank then reads only its own shards: DCP reads
one saved tensor at a time and narrows it. The folder is removed once every rank of the node has read it.

A process rather than the rank itself: a rank that built the whole model would keep its pages (and the allocator's
high-water mark) for the rest of the run. Non-persistent buffers (a causal mask, rotary tables) are in no state
dict: they are saved under entries of their own. The RNG state after the build is one process's too (the data
order and dropout draw from it), so the process writes it beside the values.

    python -m runner.engine.parallel.seed <folder>     (the folder holds spec.yaml and inputs.pt; see write)
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

SPEC, INPUTS, VALUES, RNG, SAID, FAILED = "spec.yaml", "inputs.pt", "values", "rng.pt", "said.txt", "failed.txt"


def folder(run_dir: str, rank: int, local_rank: int) -> Path:
    """This node's seed folder: named by the global rank of the node's local rank 0, so that nodes sharing a
    disk do not write into one folder."""
    return Path(run_dir) / f".seed-{rank - local_rank}"


def write(spec: Any, data: Any, env: Any, rng_before: dict) -> Path:
    """The seed checkpoint of this node, written by a process that node's local rank 0 starts (a collective:
    every rank waits until every node's is written). A failed build raises on every rank: its SpecError line
    where the build refused its input, a RuntimeError with the process's last lines otherwise."""
    from runner.engine.parallel.collectives import gather_objects
    from runner.specs.components import DATA_DECIDED
    from runner.specs.run import SpecError

    where = folder(spec.run_dir, env.rank, env.local_rank)
    fresh = not Path(spec.run_dir).exists()  # an engine started without the launcher, which writes spec.yaml first
    failure = ("", "")
    if env.local_rank == 0:
        failure = _run(spec, {name: getattr(data, name, None) for name in DATA_DECIDED}, rng_before, where)
    failures = [f for f in gather_objects(failure) if f[1]]
    if failures:
        kind, message = failures[0]
        if env.local_rank == 0:  # nothing half-written is left by a refused run
            shutil.rmtree(where, ignore_errors=True)
            if fresh:
                with contextlib.suppress(OSError):
                    Path(spec.run_dir).rmdir()
        raise SpecError(message) if kind == "spec" else RuntimeError(f"the seed checkpoint was not written: {message}")
    return where


def _run(spec: Any, decided: dict, rng_before: dict, where: Path) -> tuple[str, str]:
    """Starts the seed process and waits for it: ("", "") when it wrote the seed, else (kind, one line)."""
    shutil.rmtree(where, ignore_errors=True)  # a folder left by a killed start
    where.mkdir(parents=True)
    (where / SPEC).write_text(spec.to_yaml())
    with open(where / INPUTS, "wb") as f:
        pickle.dump({"data": decided, "rng": {k: v for k, v in rng_before.items() if k != "cuda"}}, f)
    # the rank's import path (a user's package found by a path the rank added), and no GPU: the build is the CPU's,
    # as one process's is, and a CUDA context would cost the process hundreds of MiB of device memory for nothing
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "runner.engine.parallel.seed", str(where)], env=env,
                          capture_output=True, text=True)
    if done.returncode == 0:
        return "", ""
    if (where / FAILED).exists():
        return "spec", (where / FAILED).read_text().strip()
    tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
    return "error", f"exit code {done.returncode}: {' | '.join(tail)}"


def said(where: Path) -> list[str]:
    """The lines the seed process's build would have logged in one process (model.weights' report)."""
    path = where / SAID
    return path.read_text().splitlines() if path.exists() else []


def rng_after(where: Path) -> dict:
    """The RNG state one process has once its model is built."""
    with open(where / RNG, "rb") as f:
        return pickle.load(f)


def load(module: nn.Module, where: Path) -> None:
    """This rank's shards of `module` (materialised, any mesh; a pipeline rank's part under the whole model's
    names) and its non-persistent buffers, from the seed checkpoint at `where`; nothing else is read."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from runner.engine.parallel.state import placed_like

    options = StateDictOptions(full_state_dict=False)
    model = get_model_state_dict(module, options=options)
    # A tensor-parallel split of a fused projection (_StridedShard: each rank holds its rows of q, of k and of v,
    # three ranges, not one chunk) cannot be described to DCP as one piece of the saved tensor: those few tensors
    # are read whole, one at a time, and laid out as the parameter (placed_like, no communication).
    strided = {name: model.pop(name) for name in [n for n, t in model.items() if _strided(t)]}
    state = {"model": model, "buffers": {name: b for name, b in non_persistent_buffers(module)}}
    _read(state, where)  # each rank its own shards: no collective
    for name, like in strided.items():
        whole = {"model": {name: torch.empty(like.shape, dtype=like.dtype)}}
        _read(whole, where)
        model[name] = placed_like(whole["model"][name], like)
    set_model_state_dict(module, model, options=options)


def _read(state: dict, where: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # no_dist: DCP warns that it loads "in a single process", as asked
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.load(state, checkpoint_id=str(where / VALUES), no_dist=True)


def remove(where: Path, env: Any) -> None:
    """After every rank read it (a collective): the node's local rank 0 removes the folder."""
    from runner.engine.parallel.collectives import barrier

    barrier()
    if env.local_rank == 0:
        shutil.rmtree(where, ignore_errors=True)


def non_persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of every buffer a state dict leaves out, under the names of `module`."""
    found = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if sub is None:
            continue
        for name in getattr(sub, "_non_persistent_buffers_set", ()):
            buffer = sub._buffers.get(name)
            if buffer is not None:
                found.append((f"{prefix}.{name}" if prefix else name, buffer))
    return found


def _strided(t: Any) -> bool:
    """Whether the tensor-parallel placement (the mesh's last dimension) is a fused projection's strided split.
    FSDP's own _StridedShard over a tensor-parallel Shard (fsdp x tp) is one contiguous chunk: DCP reads it."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = getattr(t, "placements", ())
    return bool(placements) and isinstance(placements[-1], _StridedShard)


def _main(where: Path) -> int:
    """The seed process: the whole model as one process builds it, written to `where` with DCP."""
    import types

    import torch.distributed.checkpoint as dcp

    from runner.engine import rng
    from runner.engine.finetune import whole_model
    from runner.specs.run import RunSpec, SpecError

    spec = RunSpec.from_yaml((where / SPEC).read_text())
    with open(where / INPUTS, "rb") as f:
        inputs = pickle.load(f)
    rng.set_rng_state(inputs["rng"])
    lines: list[str] = []
    try:
        model = whole_model(spec, types.SimpleNamespace(**inputs["data"]), lines.append)
    except SpecError as e:
        (where / FAILED).write_text(str(e))
        return 2
    after = rng.rng_state()
    state = {"model": model.state_dict(), "buffers": {name: b for name, b in non_persistent_buffers(model)}}
    dcp.save(state, checkpoint_id=str(where / VALUES), no_dist=True)
    with open(where / RNG, "wb") as f:
        pickle.dump(after, f)
    (where / SAID).write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(_main(Path(sys.argv[1])))
