"""Running one trial's job in a slot.

With one slot the job goes through `launcher.launch` in this thread, like any Hydra sweep. With
several slots and Hydra's basic launcher, each job runs `launcher.launch` in a spawned process of
its own (as hydra-joblib-launcher does): Hydra's job setup (the HydraConfig singleton, logging,
the working directory) is process-global and cannot run twice at once in one process, and a
process per trial isolates memory, CUDA state and crashes. Other launchers (submitit, joblib, ray)
already run jobs elsewhere; each slot thread calls their `launch` with its one job.
On a machine with several GPUs each slot's process sees only its own: CUDA_VISIBLE_DEVICES.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher

_spawn_lock = threading.Lock()  # os.environ is per process: set a slot's devices only while spawning
_live: set[multiprocessing.process.BaseProcess] = set()


class JobDied(RuntimeError):
    """The job's process ended without a result: killed by a signal, or exited."""

    def __init__(self, exitcode: int | None):
        self.killed = exitcode is None or exitcode < 0
        how = f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exited with code {exitcode}"
        super().__init__(f"the job's process {how} before returning a result")


def launch(launcher: Launcher, overrides: Sequence[str], idx: int, slot: int, spawn: bool) -> Any:
    """The job's return value; raises the job's exception (optuna.TrialPruned for a pruned run)."""
    if not spawn:
        return _value(launcher.launch([list(overrides)], initial_job_idx=idx)[0])
    import cloudpickle

    payload = cloudpickle.dumps((launcher, list(overrides), idx, Singleton.get_state()))
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run_in_child, args=(payload, sender, os.getpid()), name=f"trial-{idx}")
    with _spawn_lock:
        saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES",)}
        os.environ.update(slot_env(slot))
        try:
            process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    _live.add(process)
    sender.close()
    try:
        kind, value = cloudpickle.loads(receiver.recv_bytes())
    except EOFError:
        process.join()
        raise JobDied(process.exitcode) from None
    finally:
        process.join()
        _live.discard(process)
        receiver.close()
    if kind == "error":
        raise value
    return value


def _value(ret: JobReturn) -> Any:
    """The job's return value, or its exception raised here (JobReturn.return_value would also
    print 'Error executing job' for every pruned trial)."""
    if ret.status == JobStatus.COMPLETED:
        return ret.return_value
    raise ret._return_value


def terminate_all() -> None:
    """Stop every running job process (the sweep was interrupted)."""
    for process in list(_live):
        if process.is_alive():
            process.terminate()


def slot_env(slot: int) -> dict[str, str]:
    devices = _visible_gpus()
    return {"CUDA_VISIBLE_DEVICES": devices[slot % len(devices)]} if len(devices) > 1 else {}


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def _run_in_child(payload: bytes, sender: Any, parent_pid: int) -> None:
    import cloudpickle

    _exit_with_parent(parent_pid)
    launcher, overrides, idx, singleton_state = cloudpickle.loads(payload)
    Singleton.set_state(singleton_state)
    try:
        result: tuple[str, Any] = ("value", _value(launcher.launch([overrides], initial_job_idx=idx)[0]))
    except KeyboardInterrupt:
        os._exit(130)
    except SystemExit as e:  # the task function chose to exit (runner: a bad spec exits 2)
        result = ("error", RuntimeError(f"the job exited with code {e.code}"))
    except BaseException as e:  # noqa: BLE001 - everything else goes back to the sweeper
        result = ("error", e)
    try:
        data = cloudpickle.dumps(result)
    except Exception:  # an exception that does not pickle: send its text
        data = cloudpickle.dumps(("error", RuntimeError(f"{type(result[1]).__name__}: {result[1]}")))
    sender.send_bytes(data)
    sender.close()


def _exit_with_parent(parent_pid: int) -> None:
    """A sweep killed with SIGKILL cannot stop its children: they stop themselves, and the trial,
    no longer heartbeating, is failed (and retried) by the next sweep on the study."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(137)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
