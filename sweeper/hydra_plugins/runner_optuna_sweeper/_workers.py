"""A long-lived process per slot that runs trial after trial.

A fresh process per trial costs its start (unpickling the launcher and the app, imports, a CUDA
context, the first composition) on every trial: short trials spent more time starting than running,
and two slots ran slower than one. Each slot now keeps one process that receives trial after trial
over a pipe: forked from the sweep process itself as the sweep starts (it has the app, Hydra and
Optuna imported already), then imports what the hook names (runner: the engine, torch) while the
study opens. Between trials it puts back what a fresh process would have: the sweep's environment
plus the slot's share (CUDA_VISIBLE_DEVICES stays the slot's), fresh random seeds (Python's, NumPy's
and torch's global generators on every device, as a new process seeds them), torch's global
switches as they were when the process started (determinism, TF32, cudnn.benchmark, thread count),
and after the trial it frees torch.compile's caches and the CUDA memory the trial left cached (peak
statistics too). Hydra's singletons are set once, as the sweep has them; each job sets its own
HydraConfig. What it cannot undo is the app's own module-level state, as within an n_jobs=1 sweep,
whose trials all run in the sweep process.

A trial that fails retires its process (a failure may leave anything behind, a broken CUDA context
above all); one that dies (killed, out of memory) is JobDied as before. Either way the slot's next
trial starts a new process, through the fork server (_slots): the sweep runs threads by then.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import random
import signal
import sys
import threading
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.plugins.launcher import Launcher

from . import _slots, _stopping

# torch's global switches in a new process, for a slot process that imports torch only in a trial
_TORCH_DEFAULTS = {"deterministic": False, "benchmark": False, "cudnn_deterministic": False, "matmul": "highest",
                   "cuda_tf32": False, "cudnn_tf32": True}


class SlotProcess:
    """One slot's process: `run` sends it a trial and waits for the outcome.

    `fork`: forked from the sweep process itself, which has the app, Hydra and Optuna imported
    already (milliseconds, where a fork server takes a second to start); only safe while the sweep
    runs no other thread, so only the first processes, started before the study loop. `inherited`:
    the sweep's ends of earlier slots' pipes, which a forked child must not keep open."""

    def __init__(self, launcher: Launcher, slot: int, slots: int, preload: Sequence[str], fork: bool = False,
                 inherited: Sequence[Any] = ()):
        import cloudpickle

        self.slot, self.slots = slot, slots
        ctx = multiprocessing.get_context("fork") if fork else _slots.context()
        self.conn, child = ctx.Pipe(duplex=True)
        start = (launcher, self._env(), os.getpid(), Singleton.get_state(), list(preload))
        if fork:  # nothing to pickle: the child has it all
            args: tuple = (start, child, [self.conn, *inherited])
        else:
            args = (cloudpickle.dumps(start), child, [])
        self.process = ctx.Process(target=_serve, args=args, name=f"slot-{slot}", daemon=False)
        self.process.start()
        _slots.live.add(self.process)
        child.close()

    def _env(self) -> dict[str, str]:
        # the sweep's environment now (the hook's MLflow parent run id) + the slot's share
        return {**os.environ, **_slots.slot_env(self.slot, self.slots)}

    def alive(self) -> bool:
        return self.process.is_alive()

    def run(self, overrides: Sequence[str], idx: int, hidden: Sequence[str]) -> tuple[str, Any]:
        import cloudpickle

        try:
            self.conn.send_bytes(cloudpickle.dumps((list(overrides), idx, self._env(), list(hidden))))
            return cloudpickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            self.process.join()
            self.close()
            raise _slots.JobDied(self.process.exitcode) from None

    def stop(self) -> None:
        try:
            self.conn.send_bytes(b"")  # "no more trials" (a fork of the sweep may hold this pipe open too)
        except OSError:
            pass

    def close(self, wait_s: float = 10.0) -> None:
        """End the process: it exits when told; one that does not is terminated."""
        self.stop()
        self.process.join(wait_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.conn.close()
        _slots.live.discard(self.process)


class SlotProcesses:
    """The slots' processes: forked at the start, replaced through the fork server after a failure."""

    def __init__(self, launcher: Launcher, slots: int, preload: Sequence[str]):
        self.launcher, self.slots, self.preload = launcher, slots, list(preload)
        self.by_slot: dict[int, SlotProcess] = {}
        self.lock = threading.Lock()

    def start(self) -> bool:
        """Fork every slot's process now, from the main thread, before the study loop starts threads;
        False where that is not safe (not Linux, or threads running): slots start through the fork server."""
        if not sys.platform.startswith("linux") or threading.active_count() > 1:
            return False
        os.environ[_slots.SWEEP_PID_ENV] = str(os.getpid())  # for a fork server started later (_forkserver_guard)
        for slot in range(self.slots):
            inherited = [w.conn for w in self.by_slot.values()]
            self.by_slot[slot] = SlotProcess(self.launcher, slot, self.slots, self.preload, fork=True,
                                             inherited=inherited)
        return True

    def launch(self, overrides: Sequence[str], idx: int, slot: int, hidden: Sequence[str] = ()) -> Any:
        """The job's return value; raises the job's exception (optuna.TrialPruned for a pruned run)."""
        with self.lock:
            worker = self.by_slot.get(slot)
        if worker is None or not worker.alive():  # one slot is one thread: no other trial uses this entry
            if worker is not None:
                worker.close()
            worker = SlotProcess(self.launcher, slot, self.slots, self.preload)
            with self.lock:
                self.by_slot[slot] = worker
        try:
            kind, value = worker.run(overrides, idx, hidden)
        except _slots.JobDied:
            self._drop(slot)
            raise
        if kind == "error":
            if type(value).__name__ != "TrialPruned":  # a failure may leave anything behind: a new process
                worker.close()
                self._drop(slot)
            raise value
        return value

    def _drop(self, slot: int) -> None:
        with self.lock:
            self.by_slot.pop(slot, None)

    def close(self) -> None:
        with self.lock:
            workers, self.by_slot = list(self.by_slot.values()), {}
        for worker in workers:  # all first: the processes exit side by side
            worker.stop()
        for worker in workers:
            worker.close()


def _serve(start: Any, conn: Any, inherited: list[Any]) -> None:
    # SIGTERM (the sweep's death, or terminate_all) interrupts the job as Ctrl-C would: see _slots. Before or
    # between trials there is no trial to end: the process leaves without a word (it printed the traceback of
    # whatever import the signal interrupted).
    try:
        with _stopping.resent_when_dropped():
            _serve_trials(start, conn, inherited)
    except KeyboardInterrupt:
        os._exit(130)


def _serve_trials(start: Any, conn: Any, inherited: list[Any]) -> None:
    import cloudpickle

    for other in inherited:
        other.close()
    launcher, env, sweep_pid, singleton_state, preload = start if isinstance(start, tuple) else cloudpickle.loads(start)
    signal.signal(signal.SIGTERM, _stopping.slot_interrupt)
    _slots.die_with_parent(signal.SIGTERM, os.getppid(), sweep_pid)
    os.environ.clear()
    os.environ.update(env)  # before CUDA initializes: CUDA_VISIBLE_DEVICES picks this slot's GPU
    # Hydra's singletons as the sweep has them, once: each job sets its own HydraConfig and JobRuntime
    Singleton.set_state(singleton_state)
    for module in preload:  # what every job imports (the engine, torch), before the first trial is asked for
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the job that needs it will report it
            pass
    torch_switches = _torch_switches() if "torch" in sys.modules else dict(_TORCH_DEFAULTS)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError, KeyboardInterrupt):  # the sweep is gone
            os._exit(0)
        if not message:  # the sweep is done with this slot
            os._exit(0)
        overrides, idx, env, hidden = cloudpickle.loads(message)
        fresh_state(env, torch_switches)
        conn.send_bytes(_slots.run_job_here(launcher, overrides, idx, hidden))
        clean_up()


def fresh_state(env: dict[str, str], torch_switches: dict[str, Any]) -> None:
    """What a new process would start the trial with (see the module docstring)."""
    os.environ.clear()
    os.environ.update(env)
    random.seed()  # from the OS's entropy, as at a new process's start
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.seed()  # a non-deterministic seed on every device, as a new process has
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    torch.use_deterministic_algorithms(torch_switches["deterministic"])
    torch.backends.cudnn.benchmark = torch_switches["benchmark"]
    torch.backends.cudnn.deterministic = torch_switches["cudnn_deterministic"]
    torch.set_float32_matmul_precision(torch_switches["matmul"])
    torch.backends.cuda.matmul.allow_tf32 = torch_switches["cuda_tf32"]
    torch.backends.cudnn.allow_tf32 = torch_switches["cudnn_tf32"]


def clean_up() -> None:
    """Free what the last trial left: its objects, compiled graphs, cached CUDA memory."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    gc.collect()  # a model or optimizer in a reference cycle holds its memory until collected
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        for device in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(device)


def _torch_switches() -> dict[str, Any]:
    torch = sys.modules["torch"]
    return {"deterministic": torch.are_deterministic_algorithms_enabled(), "benchmark": torch.backends.cudnn.benchmark,
            "cudnn_deterministic": torch.backends.cudnn.deterministic, "matmul": torch.get_float32_matmul_precision(),
            "cuda_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_tf32": torch.backends.cudnn.allow_tf32}

