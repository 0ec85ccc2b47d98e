"""A signal handler's exception that a finalizer dropped, raised again.

A handler's exception is raised wherever the main thread is, a finalizer included (SQLAlchemy's connection pool
and MLflow's run one on many store calls), where Python prints "Exception ignored in ..." with a traceback and
drops it: the process would go on as if no signal came. The sweep's stop (_stopping), its slot processes
(_workers) and runner's own run stop and launcher (runner/engine/preemption.py, runner/cli/launch.py) use this.
"""
from __future__ import annotations

import _thread
import contextlib
import os
import sys
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def raised_again_when_dropped(signal_of: Callable[[BaseException], int]) -> Iterator[None]:
    """While inside, an exception for which `signal_of` gives a signal number is printed by no one and that signal is
    sent again, from another thread, so that the main thread's handler runs again once this hook has returned
    (os.kill or _thread.interrupt_main in the hook would run the handler inside the hook, where Python drops the
    exception again and prints "Exception ignored in sys.unraisablehook")."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        signum = signal_of(unraisable.exc_value)
        if signum:
            _thread.start_new_thread(os.kill, (os.getpid(), signum))
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
