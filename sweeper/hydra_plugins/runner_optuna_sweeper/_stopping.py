"""Stopping a sweep by SIGTERM or SIGHUP (docker stop, a batch system's preemption, a closed terminal) as Ctrl-C
stops it: its trials stopped, the study's books and the parent run ended KILLED, one line, exit 128 + the signal.

Where the trials run decides how the signal reaches them:
- in this process (one slot, Hydra's basic launcher): the handler raises SweepStopped in the main thread, as
  Ctrl-C raises KeyboardInterrupt; a trial that trains has its own handler meanwhile (runner's stop at a step
  boundary).
- in the slots' processes (_workers): the study loop sees the signal and terminates them (_slots.terminate_all).
- in a launcher's processes on this machine (joblib's workers): the handler sends the
  signal on to this process's children at once, and to any that start while the sweep stops, and the study loop
  launches nothing more. Ctrl-C reaches them through the terminal's process group; a signal sent to the sweep
  alone did not, and the sweep waited for its trials to end by themselves.

In the last two cases the handler raises nothing: the study loop checks `signum`. An exception raised by a
handler lands wherever the main thread is, a finalizer included (SQLAlchemy's connection pool runs them on
every storage call), where Python prints "Exception ignored in ..." and drops it. An interrupt that a
finalizer drops all the same is sent again, quietly (sys.unraisablehook), here and in the slots' processes.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

from hydra_plugins.runner_optuna_sweeper.dropped import raised_again_when_dropped

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class SweepStopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the sweep: it stops as on Ctrl-C, and the process exits with 128 + the signal's
    number (`exit_code`)."""

    def __init__(self, signum: int):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class SweepGone(KeyboardInterrupt):
    """SIGTERM to a slot's process (the sweep stops, or died): its job is interrupted as on Ctrl-C."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"signal {signum}: the sweep is gone")


class StopSignals:
    """The sweep's handlers for SIGTERM and SIGHUP while its study runs (see the module docstring).
    `raise_now`: trials run in this process; `send_on`: they run in a launcher's processes here."""

    def __init__(self, raise_now: bool, send_on: bool):
        self.raise_now, self.send_on = raise_now, send_on
        self.signum = 0  # the first stop signal, 0 until one comes
        self.sent: set[int] = set()  # the children the signal was sent on to

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignals"]:
        """Signal handlers belong to the main thread: elsewhere nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        with resent_when_dropped():
            try:
                yield self
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        if self.send_on:
            self.send_to_children()
        if self.raise_now:
            raise SweepStopped(self.signum)

    def check(self) -> None:
        """Raise SweepStopped once a stop signal came (the study loop calls this between its waits)."""
        if self.signum:
            raise SweepStopped(self.signum)

    def send_to_children(self) -> None:
        """The stop signal to each child process of this one it has not reached yet. Helpers that must outlive
        the jobs ignore it (loky's resource tracker, runner's tracking process). Only Python interpreters are
        sent it: a launcher's workers are, and its tools are not (loky runs `pgrep` to find the workers' own
        children as it kills them; a SIGTERM there raised in loky's thread, whose traceback the user saw).
        Linux's /proc names the children; elsewhere nothing is sent."""
        for pid in children(os.getpid()):
            if pid not in self.sent and runs_this_interpreter(pid):
                self.sent.add(pid)
                try:
                    os.kill(pid, self.signum)
                except (ProcessLookupError, PermissionError):
                    pass


def children(parent: int) -> list[int]:
    """The processes whose parent is `parent`, from /proc (empty where there is none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return found


def runs_this_interpreter(pid: int) -> bool:
    """Whether process `pid` runs the same executable as this process (False once it ended)."""
    try:
        return os.readlink(f"/proc/{pid}/exe") == os.readlink("/proc/self/exe")
    except OSError:
        return False


def slot_interrupt(signum: int, frame: Any) -> None:
    """A slot process's SIGTERM handler: its job stops as on Ctrl-C."""
    raise SweepGone(signum)


def resent_when_dropped() -> contextlib.AbstractContextManager[None]:
    """While inside, an interrupt of ours that a finalizer dropped ("Exception ignored in ...") is sent again
    and printed by no one: the main thread takes it once the finalizer has returned (dropped.py)."""
    return raised_again_when_dropped(_our_interrupt)


def _our_interrupt(e: BaseException) -> int:
    return e.signum if isinstance(e, (SweepStopped, SweepGone)) else 0
