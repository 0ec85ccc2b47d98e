"""The processes and devices a run asks for, against what it has: under the user's own torchrun, torchrun's
processes against the degrees; `trainer.device=cuda` where no GPU is visible, or more processes on this node than
GPUs to give each its own. Checked by preflight (runner/cli/preflight.py) before any run directory, spec.yaml or
MLflow store exists, and by the launcher before it starts workers (a sweep's later jobs, k-fold's folds, a
reproduced run): one line naming the key, the value and what this machine has.

A run on the default device in one process has nothing to count, and imports no torch here (a single run's
start-up imports it later, beside its tracking process).
"""
from __future__ import annotations

import os
from typing import Any

from runner.cli.run_dir import under_torchrun
from runner.specs.fields import SpecError
from runner.specs.parallelism import nominal_world, resolve_degrees


def processes_on_this_node(spec: Any) -> int:
    """The processes that will each take a device of this node: torchrun's own (the user's --nproc-per-node) under
    the user's torchrun, else the launcher's (nproc_per_node; under single, tp x pp x cp); eval, predict and
    export run in this process."""
    if under_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if spec.mode != "train":
        return 1
    par = spec.parallelism
    return max(1, nominal_world(par) // max(1, par.nnodes))


def check_devices(spec: Any) -> None:
    """Refuse (SpecError, one line) a device this machine does not have, or fewer GPUs than processes."""
    asked = spec.trainer.device
    nproc = processes_on_this_node(spec)
    if asked == "cpu" or (asked == "auto" and nproc == 1):
        return  # one process on the device at hand, whatever it is
    import torch

    from runner.engine.parallel import pick_device

    if pick_device(asked).type != "cuda":  # raises for trainer.device=cuda without a GPU; auto without one is the cpu
        return
    visible = torch.cuda.device_count()
    if nproc <= visible:
        return
    if under_torchrun():
        raise SpecError(f"trainer.device: {asked!r} with torchrun's {nproc} processes on this node but only {visible} "
                        f"GPU(s) visible; start at most {visible} (torchrun --nproc-per-node), or trainer.device=cpu")
    par = spec.parallelism
    # single: tp x pp x cp processes, set by those keys
    key = "nproc_per_node" if par.name != "single" else next(k for k in ("tp", "pp", "cp") if getattr(par, k) > 1)
    raise SpecError(f"parallelism.{key}: {nproc} workers but only {visible} GPU(s) visible on this node "
                    f"(trainer.device={asked}); use at most {visible}, or trainer.device=cpu")


def check_processes(spec: Any) -> None:
    """Under the user's own torchrun (whose processes, not the spec, make the run): its WORLD_SIZE against the
    degrees, before rank 0 names the run directory."""
    if not under_torchrun() or "WORLD_SIZE" not in os.environ:
        return
    world, par = int(os.environ["WORLD_SIZE"]), spec.parallelism
    if par.name == "single" and world != nominal_world(par):
        raise SpecError(f"parallelism: torchrun started {world} processes but parallelism=single runs "
                        f"{nominal_world(par)} (tp x pp x cp); add parallelism=ddp or parallelism=fsdp")
    resolve_degrees(par, world, "torchrun's WORLD_SIZE")
