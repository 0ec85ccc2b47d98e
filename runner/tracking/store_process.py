"""The tracking process: a run's MLflow store, opened and called in a child process of its own.

Importing MLflow and opening a store costs about 3 s of CPU (MLflow imports pandas, alembic, SQLAlchemy and
its GenAI modules). In a thread of the training process it holds the GIL while the main thread imports
torch and builds the run, so the two add up before the first step. In a child process started as the run
starts, it runs on another core meanwhile, and the training process never imports MLflow on the default
path. The child answers the calls of runner/tracking/store.py (`Store`), one at a time, over a pipe, in
plain data; the writer's thread (runner/tracking/writer.py) makes them, as it would on an MlflowClient,
with the same retries and outage reports. The run's journal stays in the training process, so a child
that dies loses nothing: it is said in one line, training goes on, and what the store lacks is logged
from the journal by `trainer.resume` or the next runner command on the store.

The child ignores the terminal's signals (Ctrl-C reaches the whole process group: the training process
ends the run KILLED through it) and exits when the training process closes the pipe or dies. It outlives
the training process only to end, KILLED, the runs that process opened and left RUNNING when it died without
saying goodbye (SIGKILL, an OOM kill, its launcher gone: runner/cli/lifetime.py).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)

# the records of the child's loggers that reach the training process's log (its console and runner.log)
_FORWARD_LEVEL = logging.WARNING


class StoreGone(ConnectionError):
    """The tracking process died: nothing more reaches the store from this run."""

    refused = False
    process_gone = True  # what runner/tracking/writer.py looks for (it imports nothing from here)


class StoreError(Exception):
    """An error a store call raised in the tracking process: its type's name, MLflow's error code (None for
    other errors) and whether the store understood the call and refused it (runner/tracking/writer.py)."""

    def __init__(self, message: str, type_name: str, error_code: str | None, refused: bool):
        super().__init__(message)
        self.type_name, self.error_code, self.refused = type_name, error_code, refused


class StoreProcess:
    """The training process's side: `open` starts the child and asks it to open the store at once; `opened`
    waits for its answer; every other method is the same call on the child's `Store`."""

    def __init__(self) -> None:
        from multiprocessing.connection import Connection

        to_child, self._to_child_w = os.pipe()
        self._from_child_r, from_child = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        env.pop("RUNNER_TEST_HOLD_DECISION", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "runner.tracking.store_process", str(to_child),
                                      str(from_child)], pass_fds=(to_child, from_child), env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(to_child)
        os.close(from_child)
        self._send_conn = Connection(self._to_child_w, readable=False)
        self._recv_conn = Connection(self._from_child_r, writable=False)
        self._lock = threading.Lock()  # one call at a time: the main thread's, or the writer's
        self._opening: tuple[str, str, str] | None = None
        self._opened: str | BaseException | None = None
        self.gone: str | None = None   # how the child ended, once it has
        self.closed = False
        _live.add(self)

    @property
    def usable(self) -> bool:
        return not self.closed and self.gone is None

    def open(self, uri: str, experiment: str, artifact_root: str) -> None:
        """Ask the child to open the store now; `opened` takes its answer."""
        self._opening = (uri, experiment, artifact_root)
        with self._lock:
            self._send_conn.send(("open", (uri, experiment, artifact_root)))

    def opened(self) -> str:
        """The experiment's id, once the child has opened the store; its refusal (a SpecError) raised."""
        if self._opened is None:
            try:
                with self._lock:
                    self._opened = self._answer()
            except BaseException as e:  # noqa: BLE001  (raised below, and again by a later call)
                self._opened = e
        if isinstance(self._opened, BaseException):
            raise self._opened
        return self._opened

    def __getattr__(self, verb: str) -> Any:
        if verb.startswith("_") or verb not in _VERBS:
            raise AttributeError(verb)

        def call(*args: Any) -> Any:
            self.opened()
            with self._lock:
                try:
                    self._send_conn.send((verb, args))
                except OSError:
                    self._ended()
                return self._answer()

        return call

    def _answer(self) -> Any:
        try:
            kind, value, records = self._recv_conn.recv()
        except (EOFError, OSError):
            self._ended()
        for name, level, message in records:
            logging.getLogger(name).log(level, "%s", message)
        if kind == "ok":
            return value
        message, type_name, error_code, refused, spec_error = value
        if spec_error:
            from runner.specs.run import SpecError

            raise SpecError(message)
        raise StoreError(message, type_name, error_code, refused)

    def _ended(self) -> None:
        code = self.proc.wait()
        self.gone = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        raise StoreGone(f"the tracking process (pid {self.proc.pid}) ended ({self.gone})")

    def close(self, timeout: float = 30.0) -> None:
        """The child exits once it has answered what it was asked; waited for (its CPU is the run's), and
        killed after `timeout` seconds (a store call that hangs: the journal holds what it was storing)."""
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        if self._lock.acquire(timeout=1.0):  # a call in flight that hangs: no goodbye, the child ends after it
            try:
                self._send_conn.send((_GOODBYE, ()))
            except OSError:
                pass
            finally:
                self._lock.release()
        self._send_conn.close()  # not under the lock: a call in flight may hang; the child ends after it
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self._lock:
            self._recv_conn.close()


_early: StoreProcess | None = None  # started as the run starts, for the tracker that opens the same store


def start_early(uri: str, experiment: str, artifact_root: str) -> None:
    """Start the tracking process and its opening of the store now (preflight does, before importing torch);
    the run's tracker takes it (`started`) where it tracks to the same store."""
    global _early
    from runner.tracking import sqlite_store

    if sqlite_store.usable(uri):  # the run writes this store itself, without MLflow (runner/tracking/sqlite_store.py)
        return
    _early = StoreProcess()
    _early.open(uri, experiment, artifact_root)


def pending() -> bool:
    """Whether a tracking process was started early and no tracker has taken it yet."""
    return _early is not None


def started(uri: str, experiment: str, artifact_root: str) -> StoreProcess:
    """The tracking process opening this store: the one started early where it opens the same, else a new one."""
    global _early
    early, _early = _early, None
    if early is not None and early._opening == (uri, experiment, artifact_root):
        return early
    if early is not None:
        early.close()
    process = StoreProcess()
    process.open(uri, experiment, artifact_root)
    return process


_live: "weakref.WeakSet[StoreProcess]" = weakref.WeakSet()


@atexit.register  # registered before runner/tracking/writer.py's own: runs after it stored what was left
def _close_at_exit() -> None:
    for process in list(_live):
        process.close(timeout=5.0)


_VERBS = {"run", "logged_steps", "reattach", "create_run", "set_terminated", "log_metrics", "make_call"}
_GOODBYE = "goodbye"  # the training process closes the pipe on purpose: what it left RUNNING stays so


class _Forwarded(logging.Handler):
    """The child's log records, kept to go back with the answer of the call that made them."""

    def __init__(self) -> None:
        super().__init__(_FORWARD_LEVEL)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.name, record.levelno, record.getMessage()))
        except Exception:  # noqa: BLE001  (a record that cannot be formatted is left out)
            pass


def serve(requests_fd: int, answers_fd: int) -> None:
    """The child: answer each call until the training process closes the pipe."""
    from multiprocessing.connection import Connection

    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    forwarded = _Forwarded()
    logging.root.addHandler(forwarded)
    logging.root.setLevel(_FORWARD_LEVEL)  # records below it would be made only to be dropped
    requests, answers = Connection(requests_fd, writable=False), Connection(answers_fd, readable=False)
    from runner.tracking.store import Store
    from runner.tracking.writer import refused
    from runner.specs.run import SpecError

    store = Store()
    running: set[str] = set()  # runs the training process opened and has not ended
    while True:
        try:
            verb, args = requests.recv()
        except (EOFError, OSError):  # the training process died
            _end_killed(store, running)
            return
        if verb == _GOODBYE:
            return
        try:
            answer: tuple = ("ok", getattr(store, verb)(*args))
            if verb in ("create_run", "reattach"):
                running.add(answer[1] if verb == "create_run" else args[0])
            elif verb == "set_terminated":
                running.discard(args[0])
        except BaseException as e:  # noqa: BLE001  (every error goes back to the caller)
            text = str(e).strip() or type(e).__name__
            answer = ("error", (text, type(e).__name__, getattr(e, "error_code", None), refused(e),
                                isinstance(e, SpecError)))
        records, forwarded.records = forwarded.records, []
        try:
            answers.send((*answer, records))
        except OSError:
            return


def _end_killed(store: Any, running: set[str]) -> None:
    """The training process died without saying goodbye: its runs still RUNNING end KILLED (nobody else is left
    to end them; a later run on the store would, as an orphan)."""
    for run_id in running:
        try:
            if (store.run(run_id) or {}).get("status") == "RUNNING":
                store.set_terminated(run_id, "KILLED")
        except Exception:  # noqa: BLE001  (the store is out: the next runner command on it ends the orphan)
            pass


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
