"""Running one trial's job in a slot.

With one slot the job goes through `launcher.launch` in this thread, like any Hydra sweep. With
several slots and Hydra's basic launcher, each job runs `launcher.launch` in its slot's process
(_workers: one long-lived process per slot; the fork server here starts a slot's replacement):
Hydra's job setup (the HydraConfig singleton, logging, the working directory) is process-global and cannot run twice at once in one process, and a process of
its own isolates memory, CUDA state and crashes. Other launchers (submitit,
joblib, ray) already run jobs elsewhere; each slot thread calls their `launch` with its one job.

Start-up cost: the fork server imports once what every job needs (the app's module, and for
runner's own jobs the engine, Optuna and MLflow), so a trial starts as a fork, not as a fresh
interpreter; it imports nothing the task does not use (a toy app's jobs never import torch).
Each slot's process gets its share of the machine: its own GPU when there are several
(CUDA_VISIBLE_DEVICES), cores / slots CPU threads.

Trials die with their sweep: see _forkserver_guard and `die_with_parent`.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher

SWEEP_PID_ENV = "RUNNER_SWEEP_PID"
_GUARD = "hydra_plugins.runner_optuna_sweeper._forkserver_guard"
_KILL_AFTER_S = 10.0  # an interrupted trial's grace to end its MLflow run KILLED before it is killed
live: set[multiprocessing.process.BaseProcess] = set()
_preload: list[str] = []


class JobInterrupted(Exception):
    """The job was interrupted in a process of the launcher's own (the sweep's stop signal sent on, a
    preemption): its KeyboardInterrupt, raised there as an Exception so that Hydra's job returns it as the
    job's outcome. Raised through joblib as a KeyboardInterrupt, it made joblib end every worker of its pool
    at once, the other slots' trials included, in the midst of their own stop."""


class InterruptsAsErrors:
    """The app's task function, for a launcher that runs jobs in processes of its own (joblib's workers):
    a KeyboardInterrupt in the job becomes JobInterrupted (above). A class, not a closure: it pickles."""

    def __init__(self, task_function: Any):
        self.task_function = task_function

    def __call__(self, cfg: Any) -> Any:
        try:
            return self.task_function(cfg)
        except KeyboardInterrupt as e:
            raise JobInterrupted(str(e) or "interrupted") from None


class JobDied(RuntimeError):
    """The job's process ended without a result: killed by a signal, or exited."""

    def __init__(self, exitcode: int | None):
        self.killed = exitcode is None or exitcode < 0 or exitcode in (130, 137)  # signal, Ctrl-C, parent gone
        how = f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exited with code {exitcode}"
        super().__init__(f"the job's process {how} before returning a result")


def launch(launcher: Launcher, overrides: Sequence[str], idx: int, hidden: Sequence[str] = ()) -> Any:
    """The job's return value, the job run through `launcher.launch` in this thread (one slot, or a launcher
    that runs jobs elsewhere); raises the job's exception (optuna.TrialPruned for a pruned run).
    `hidden`: overrides the launcher's job line leaves out (the app's own, not the user's)."""
    with job_line_without(hidden):
        return _value(launcher.launch([list(overrides)], initial_job_idx=idx)[0])


def _value(ret: JobReturn) -> Any:
    """The job's return value, or its exception raised here (JobReturn.return_value would also
    print 'Error executing job' for every pruned trial). Runs where the job ran: a failure's
    traceback goes into the job's own log file, and the exception carries that file's path."""
    if ret.status == JobStatus.COMPLETED:
        return ret.return_value
    error = ret._return_value
    if type(error).__name__ != "TrialPruned" and not isinstance(error, JobInterrupted):
        try:
            error.job_log = _log_traceback(ret, error)
        except Exception:  # noqa: BLE001 - a log that cannot be written must not hide the job's error
            pass
    raise error


def _log_traceback(ret: JobReturn, error: BaseException) -> str:
    """Append the traceback to the job's log file (Hydra's job_logging file handler, else
    <job dir>/<job name>.log); the sweep's console keeps one line per failed trial."""
    job_dir = Path(str(ret.hydra_cfg.hydra.runtime.output_dir)).resolve()
    path = job_dir / f"{ret.hydra_cfg.hydra.job.name}.log"
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == job_dir:
            handler.flush()
            path = Path(handler.baseFilename)
    with open(path, "a") as f:
        f.write("the job failed:\n" + "".join(traceback.format_exception(error)))
    return str(path)


def terminate_all() -> None:
    """Stop every running job process (the sweep was interrupted)."""
    for process in list(live):
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
    """The GPUs jobs may use, without importing torch into the sweep (seconds, and a toy app's
    sweep would pay them for nothing): CUDA_VISIBLE_DEVICES, else torch's count if the app already
    imported it, else the NVIDIA driver's list of devices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    if "torch" in sys.modules:
        return [str(i) for i in range(sys.modules["torch"].cuda.device_count())]
    driver = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(driver.iterdir())))] if driver.is_dir() else []


def set_preload(modules: list[str]) -> None:
    """What the fork server imports before forking any job (see the module docstring)."""
    _preload[:] = [_GUARD, __name__, "cloudpickle", "hydra.core.utils", *modules]


def context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_preload or [_GUARD, __name__])
    return ctx


def warm_up() -> None:
    """Start the fork server now, from the main thread (its death signal is tied to the thread that
    starts it), so its imports overlap the sweep's own setup (the MLflow store)."""
    from multiprocessing import forkserver

    os.environ[SWEEP_PID_ENV] = str(os.getpid())
    context()
    forkserver.ensure_running()


class _DropOverrides(logging.Filter):
    def __init__(self, hidden: Sequence[str]):
        super().__init__()
        self.hidden = [f" {h}" for h in hidden]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if any(h in text for h in self.hidden):
            for h in self.hidden:
                text = text.replace(h, "")
            record.msg, record.args = text, ()
        return True


# the loggers of the launchers' job lines: Hydra's basic one, its joblib and submitit plugins
_JOB_LINE_LOGGERS = ("hydra._internal.core_plugins.basic_launcher", "hydra_plugins.hydra_joblib_launcher._core",
                     "hydra_plugins.hydra_submitit_launcher.submitit_launcher")


@contextlib.contextmanager
def job_line_without(hidden: Sequence[str]) -> Iterator[None]:
    """Hydra's launchers log each job as `#N : <overrides>` (hydra.* ones left out): leave these out too."""
    if not hidden:
        yield
        return
    loggers = [logging.getLogger(n) for n in _JOB_LINE_LOGGERS]
    drop = _DropOverrides(hidden)
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def run_job_here(launcher: Launcher, overrides: list[str], idx: int, hidden: Sequence[str]) -> bytes:
    """Run the job in this (trial) process: ("value", v) or ("error", exception), pickled for the sweep."""
    import cloudpickle

    try:
        with job_line_without(hidden):
            result: tuple[str, Any] = ("value", _value(launcher.launch([overrides], initial_job_idx=idx)[0]))
    except KeyboardInterrupt:
        os._exit(130)
    except SystemExit as e:  # the task function chose to exit (runner: a bad spec exits 2)
        result = ("error", RuntimeError(f"the job exited with code {e.code}"))
    except BaseException as e:  # noqa: BLE001 - everything else goes back to the sweeper
        result = ("error", e)
    try:
        return cloudpickle.dumps(result)
    except Exception:  # an exception that does not pickle: send its text
        return cloudpickle.dumps(("error", RuntimeError(f"{type(result[1]).__name__}: {result[1]}")))


def die_with_parent(sig: int, parent_pid: int, sweep_pid: int | None = None) -> None:
    """End this process when its parent (or the sweep) dies, even by SIGKILL.

    Linux delivers `sig` the moment the parent dies (PR_SET_PDEATHSIG; a trial gets SIGTERM, which
    it turns into KeyboardInterrupt). Elsewhere, and in case the signal is caught and ignored, a
    thread watches both processes and, once one is gone, signals this process and kills it
    _KILL_AFTER_S later."""
    signalled = False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            signalled = ctypes.CDLL(None, use_errno=True).prctl(1, int(sig)) == 0  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above: no signal will come
        os.kill(os.getpid(), sig)
    if signalled and sig == signal.SIGKILL and sweep_pid is None:
        return  # the kernel's SIGKILL cannot be caught: nothing to watch for

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        try:  # a killed process nobody has reaped yet still answers signal 0
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            return False

    def watch() -> None:
        while os.getppid() == parent_pid and not (sweep_pid and gone(sweep_pid)):
            time.sleep(0.5)
        os.kill(os.getpid(), sig)
        time.sleep(_KILL_AFTER_S)
        os._exit(137)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()
