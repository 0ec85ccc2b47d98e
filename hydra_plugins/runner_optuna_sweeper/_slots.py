"""Running one trial's job in a slot.

With one slot the job goes through `launcher.launch` in this thread, like any Hydra sweep. With
several slots and Hydra's basic launcher, each job runs `launcher.launch` in a process of its own
(as hydra-joblib-launcher does), forked from a fork server that imported torch and the engine once:
Hydra's job setup (the HydraConfig singleton, logging, the working directory) is process-global and
cannot run twice at once in one process, and a process per trial isolates memory, CUDA state and
crashes. Other launchers (submitit, joblib, ray) already run jobs elsewhere; each slot thread calls
their `launch` with its one job. Each slot's process gets its share of the machine: its own GPU
when there are several (CUDA_VISIBLE_DEVICES), cores / slots CPU threads.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher

# imported once by the fork server (torch, the engine, MLflow): a trial starts without re-importing
# them; a module that is not installed is skipped
_PRELOAD = ["runner.launch", "runner.trial", "optuna", "mlflow.tracking", "matplotlib"]
_live: set[multiprocessing.process.BaseProcess] = set()


class JobDied(RuntimeError):
    """The job's process ended without a result: killed by a signal, or exited."""

    def __init__(self, exitcode: int | None):
        self.killed = exitcode is None or exitcode < 0 or exitcode in (130, 137)  # signal, Ctrl-C, parent gone
        how = f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exited with code {exitcode}"
        super().__init__(f"the job's process {how} before returning a result")


def launch(launcher: Launcher, overrides: Sequence[str], idx: int, slot: int, slots: int, spawn: bool) -> Any:
    """The job's return value; raises the job's exception (optuna.TrialPruned for a pruned run)."""
    if not spawn:
        return _value(launcher.launch([list(overrides)], initial_job_idx=idx)[0])
    import cloudpickle

    env = {**os.environ, **slot_env(slot, slots)}  # the sweep's environment now (the MLflow parent run id) + the slot's share
    payload = cloudpickle.dumps((launcher, list(overrides), idx, Singleton.get_state(), env))
    receiver, sender = _context().Pipe(duplex=False)
    process = _context().Process(target=_run_in_child, args=(payload, sender), name=f"trial-{idx}")
    process.start()
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


def slot_env(slot: int, slots: int) -> dict[str, str]:
    """A slot's share of the machine: its own GPU when there are several, and cores / slots CPU
    threads (torch's default of one thread per core in every slot oversubscribes the CPU many times)."""
    env = {}
    devices = visible_gpus()
    if len(devices) > 1:
        env["CUDA_VISIBLE_DEVICES"] = devices[slot % len(devices)]
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // slots))
    return env


def visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def _context() -> Any:
    """Jobs fork from a server process that imported the heavy modules once (not from this process,
    whose threads and state a fork would copy), so a trial starts in well under a second."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD if "runner.spec" in sys.modules else [])  # runner's CLI, not another app
    return ctx


def warm_up() -> None:
    """Start the fork server now, so its imports overlap the sweep's own setup (the MLflow store)."""
    from multiprocessing import forkserver

    _context()
    forkserver.ensure_running()


def _run_in_child(payload: bytes, sender: Any) -> None:
    import cloudpickle

    _exit_with_parent(os.getppid())
    launcher, overrides, idx, singleton_state, env = cloudpickle.loads(payload)
    os.environ.clear()
    os.environ.update(env)  # before CUDA initializes: CUDA_VISIBLE_DEVICES picks this slot's GPU
    if "torch" in sys.modules:  # the fork server imported torch: its thread count is set, not read from env
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
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
    """A sweep killed with SIGKILL cannot stop its jobs: its fork server exits, and each job, seeing
    its parent gone, stops itself; the trial, no longer heartbeating, is failed (and retried) by the
    next sweep on the study."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(137)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
