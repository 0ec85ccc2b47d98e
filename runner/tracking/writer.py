"""The MLflow writer: a run's store calls, made by one background thread, so a training step never waits
for the store.

The tracker hands over metrics, params, tags, artifacts and the run's end in the order they are logged;
the thread sends them in that order (runs of metrics as MlflowClient.log_batch calls of at most 1000
values), every `send_every_s` seconds or when asked. Nothing is dropped and nothing is refused for
lack of room: what the store cannot take yet waits in memory (a warning says once when that grows
large), and the tracker's journal (runner/tracking/journal.py) holds every metric on disk as well.

A store call that fails for a reason that may pass (a server down, stopped or restarting, a sqlite
file locked or its disk full) is retried with backoff until it succeeds; the outage is said once, with
the step of the first value waiting, and so is its end. A call the store refuses (a bad metric name,
a deleted run) is not retried: its error is kept, and the tracker raises it where the run can still
end FAILED. A store that answers nothing never blocks anyone: `wait` gives up after `patience`
seconds without progress, and the thread is a daemon, so the process exits whatever it is doing.
"""
from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from typing import Any, Callable

log = logging.getLogger(__name__)

BATCH = 1000          # MLflow's limit of metric values per log_batch
_STALL_S = 10.0       # a store call this long without an answer is an outage, said once
_BACKOFF_S = (0.5, 30.0)
_MANY_WAITING = 2_000_000  # metric values waiting in memory: said once (about 300 MB)
# the MLflow error codes of a request the store understood and refused: retrying changes nothing
_REFUSED = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
            "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED", "ENDPOINT_NOT_FOUND", "MALFORMED_REQUEST",
            "INVALID_REQUEST"}


class StoreWriter:
    """`store` (runner/tracking/store.py's calls, in this process or the tracking process's) and `run_id`:
    where the values go; `where`: the store, as messages name it; `journal`: the local file holding every
    metric, as messages name it."""

    def __init__(self, store: Any, run_id: str, where: str, journal: str, send_every_s: float, patience_s: float):
        self.store, self.run_id, self.where, self.journal = store, run_id, where, journal
        self.send_every_s, self.patience_s = send_every_s, patience_s
        self._ops: collections.deque = collections.deque()  # ("metrics", step, ms, values) | ("call", step, fn, what, stored)
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self.queued = 0          # ops handed over (main thread)
        self.done = 0            # ops stored or refused (writer thread)
        self.values_queued = 0   # metric values handed over (main thread)
        self.values_done = 0     # metric values stored or refused (writer thread)
        self.last_step = 0       # the step of the newest value handed over
        self.refusals: list[BaseException] = []
        self.call_started: float | None = None  # monotonic start of the store call in flight
        self.call_step = 0                      # the training's step when that call began
        self.outage_step: int | None = None     # set while an announced outage lasts
        self.outage_reason = ""                 # its first error, as said
        self.outage_began = 0.0
        self._warned_memory = False
        self._said = threading.Lock()  # the main thread (no answer) and the writer (an error) may both see an outage
        self._closed = False
        self.end_said = False  # the tracker said, as the run ended, what the store still lacks and where it is kept
        self.gone: str | None = None  # the tracking process died: what reached no store stays in the journal
        for name in _NOISY:
            logging.getLogger(name).addFilter(_not_from_writer)
        self._thread = threading.Thread(target=self._run, name=WRITER_THREAD, daemon=True)
        self._thread.start()
        _live.add(self)

    # --- the main thread's side: a deque append per call --------------------------------------------

    def metrics(self, step: int, ms: int, values: dict[str, float]) -> None:
        self._ops.append(("metrics", step, ms, values))
        self.queued += 1
        self.values_queued += len(values)
        self.last_step = step
        waiting = self.values_queued - self.values_done
        if waiting > _MANY_WAITING and not self._warned_memory:
            self._warned_memory = True
            log.warning("MLflow at %s: %d metric values wait in memory for the store; training goes on, and every "
                        "metric is in %s", self.where, waiting, self.journal)
        started = self.call_started
        if started is not None and self.outage_step is None and time.monotonic() - started > _STALL_S:
            self._outage(f"no answer for {time.monotonic() - started:.0f} s")

    def call(self, fn: Callable[[Any], Any], what: str, stored: Callable[[], None] | None = None) -> None:
        """fn(store), in order with everything else; `what` names it in messages; `stored()` once the store
        holds it (the journal's confirmation)."""
        self._ops.append(("call", self.last_step, fn, what, stored))
        self.queued += 1

    @property
    def unreachable(self) -> bool:
        """An outage has been said and has not ended."""
        return self.outage_step is not None

    @property
    def state(self) -> str:
        """What the store is while it takes nothing, in words a user can act on: a local sqlite file cannot be
        unreachable (its calls wait on another process's lock, or on a loaded machine: it is busy) but may have
        turned read-only; a server is unreachable."""
        if "readonly" in self.outage_reason or "read-only" in self.outage_reason:
            return "read-only"
        return "busy" if self.where.startswith("sqlite:") else "unreachable"

    def send_now(self) -> None:
        self._wake.set()

    def wait(self) -> bool:
        """Until everything handed over so far is stored (or refused): True; False when the store made no
        progress for `patience_s` seconds (what is left stays queued, and the thread keeps trying)."""
        target = self.queued
        self._wake.set()
        with self._progress:
            last, since = self.done, time.monotonic()
            while self.done < target:
                self._progress.wait(0.1)
                if self.done != last:
                    last, since = self.done, time.monotonic()
                elif time.monotonic() - since > self.patience_s:
                    return False
        return True

    def close(self) -> None:
        """The thread ends once its queue is empty (at once if nothing waits)."""
        self._closed = True
        self._wake.set()
        _live.discard(self)

    def left(self) -> tuple[int, int | None, list[str]]:
        """Metric values not stored yet, the step of the first of them, and what the other calls left store."""
        ops = list(self._ops)
        first = next((op[1] for op in ops if op[0] == "metrics"), None)
        return self.values_queued - self.values_done, first, [op[3] for op in ops if op[0] == "call"]

    # --- the writer thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.send_every_s)
            self._wake.clear()
            while self._ops:
                self._send_next()
            if self._closed and not self._ops:
                return

    def _send_next(self) -> None:
        """The first op, or the run of metric ops at the front of the queue (up to BATCH values), stored."""
        head = self._ops[0]
        if head[0] == "call":
            if self._store(lambda: head[2](self.store)) and head[4] is not None:
                head[4]()
            self._ops.popleft()
            self._finished(1, 0)
            return
        metrics, ops, values, queued = [], 0, 0, len(self._ops)
        while ops < queued:  # the main thread appends at the right end meanwhile; the left end is this thread's
            op = self._ops[ops]
            if op[0] != "metrics" or (metrics and len(metrics) + len(op[3]) > BATCH):
                break
            _, step, ms, logged = op
            metrics.extend((k, v, ms, step) for k, v in logged.items())
            ops, values = ops + 1, values + len(logged)
        for i in range(0, len(metrics), BATCH):  # more than BATCH only when one log call held more
            self._store(lambda batch=metrics[i:i + BATCH]: self.store.log_metrics(self.run_id, batch))
        for _ in range(ops):
            self._ops.popleft()
        self._finished(ops, values)

    def _finished(self, ops: int, values: int) -> None:
        with self._progress:
            self.done += ops
            self.values_done += values
            self._progress.notify_all()

    def _store(self, send: Callable[[], Any]) -> bool:
        """send() until it succeeds (True) or the store refuses it (False); an outage is said once, and its end.
        After the tracking process died, nothing is sent (False): the journal holds it all."""
        delay = _BACKOFF_S[0]
        while self.gone is None:
            self.call_started, self.call_step = time.monotonic(), self.last_step
            try:
                send()
            except Exception as e:  # noqa: BLE001  (sorted below: retried, or kept for the tracker to raise)
                self.call_started = None
                if getattr(e, "process_gone", False):  # runner/tracking/store_process.py's StoreGone
                    self.gone = str(e)
                    if self._closed:  # the run has ended (this process stops its tracking process as it exits)
                        self._said_after_the_end(first_line(e))
                    else:
                        log.warning("MLflow: %s (seen at step %d); training goes on, %s holds every metric and call, "
                                    "and `trainer.resume` of this run or the next runner command on this store (on "
                                    "this host) completes the MLflow run from it", e, self.last_step, self.journal)
                    return False
                if refused(e):
                    self.refusals.append(e)
                    return False
                self._outage(first_line(e))
                time.sleep(delay)
                delay = min(delay * 2, _BACKOFF_S[1])
                continue
            self.call_started = None
            if self.outage_step is not None:
                log.warning("MLflow at %s answers again at step %d, after %.0f s; what was logged meanwhile follows in "
                            "order", self.where, self.last_step, time.monotonic() - self.outage_began)
                self.outage_step = None
            return True
        return False

    def _outage(self, reason: str) -> None:
        with self._said:
            if self.outage_step is not None:
                return
            self.outage_step, self.outage_began = self.call_step, self.call_started or time.monotonic()
            self.outage_reason = reason
        if self._closed:
            self._said_after_the_end(reason)
            return
        fix = "; make it writable again, and what waits is written" if self.state == "read-only" else ""
        log.warning("MLflow at %s: %s since step %d (%s); retrying, training goes on, and %s holds every metric%s",
                    self.where, self.state, self.outage_step, reason, self.journal, fix)


    def _said_after_the_end(self, reason: str) -> None:
        """The store failed after the run ended: training is over, so what it lacks is said plainly, once (the
        tracker's line at the run's end said it already where the store was out then)."""
        if self.end_said:
            return
        self.end_said = True
        waiting, first, calls = self.left()
        lacking = [f"{waiting} metric values (from step {first})"] * bool(waiting) + list(dict.fromkeys(calls))
        log.warning("MLflow at %s: the run has finished, but %s could not be written (%s); %s holds them, and "
                    "`trainer.resume` of this run or the next runner command on this store (on this host) completes "
                    "the MLflow run from it", self.where, ", ".join(lacking) or "what it logged last", reason,
                    self.journal)


# Within a call, MLflow's HTTP client retries and urllib3 says so each time; MLflow's sqlite store logs a
# locked or full file with a traceback. From the writer's thread the outage is said once, in its own words.
_NOISY = ("urllib3.connectionpool", "mlflow.store.db.utils", "mlflow.utils.rest_utils")
WRITER_THREAD = "runner-mlflow-writer"


def _not_from_writer(record: logging.LogRecord) -> bool:
    return record.threadName != WRITER_THREAD


_live: "weakref.WeakSet[StoreWriter]" = weakref.WeakSet()


@atexit.register
def _store_what_is_left() -> None:
    """A process that exits without ending its run (an error outside the engine, sys.exit) still stores
    what it logged, waiting as long as the store makes progress."""
    for writer in list(_live):
        writer.wait()


def refused(error: BaseException) -> bool:
    """Whether the store understood a call and refused it (not worth retrying), rather than not answering."""
    said = getattr(error, "refused", None)  # an error from the tracking process: sorted there
    if isinstance(said, bool):
        return said
    code = getattr(error, "error_code", None)
    if code is not None:  # an MlflowException: its code says
        return code in _REFUSED
    if isinstance(error, (OSError, TimeoutError, ConnectionError)):
        return False
    # sqlalchemy's OperationalError (a locked or full sqlite file) and the like may pass; a bug never does
    return "Operational" not in type(error).__name__ and "Timeout" not in type(error).__name__


# SQLAlchemy's lines around an error's own: a hint on how the failed statement was issued, and a link. A store
# turned read-only failed with "(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush
# block ...)" as its first line, which named the hint as the cause; the cause is "attempt to write a readonly database".
_SQLALCHEMY_ASIDES = ("(raised as a result of", "(Background on this error")


def first_line(error: object) -> str:
    """The line of an error that says what went wrong (SQLAlchemy's asides left out), at most 300 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(_SQLALCHEMY_ASIDES)] or lines
    return said[0][:300] if said else type(error).__name__
