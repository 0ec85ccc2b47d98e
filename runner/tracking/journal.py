"""The run directory's copy of every metric the tracker logs: `<run_dir>/metrics.jsonl`.

MLflow gets a run's metrics from a background thread (runner/tracking/writer.py), so a kill (SIGKILL,
the OOM killer, a lost node) can lose what was still queued, and a store that is down for good never
gets them. The journal is what is left then: written by the training process itself, and written out
(to the operating system, which keeps it through the process's death) whenever the tracker flushes,
which the engine does before every checkpoint. So it holds every metric a checkpoint covers, and a
resumed run logs from it what its MLflow run lacks.

One JSON line per log call: {"step": 12, "time": <ms since the epoch>, "metrics": {"train/loss": 0.31}};
the first line names the MLflow run: {"mlflow_run_id": "<id>"}; a run that ended adds its status last:
{"status": "FINISHED"} (a resumed run appends after it, and is no longer ended). Every other store call
(params, tags, artifacts, the logged model: runner/tracking/calls.py) is written at once as
{"op": "<id>", "call": "tags", "args": {...}}, and {"done": "<id>"} follows once the store holds it (a
later line with the same op id and other args replaces the call: the run record, once built); what
the store never confirmed is made again by whoever completes the run. A run its process
left RUNNING in the store (killed, or ended while the store was unreachable) is completed from here by
the next runner command that opens the store (runner/tracking/mlflow_store.py, end_orphaned_runs). NaN and infinities are written as
Python's json writes them (NaN, Infinity), which json.loads reads back.
"""
from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

FILE = "metrics.jsonl"
_WRITE_AT = 256  # log calls kept in memory before they are written out


class Journal:
    """Appends to `path` for MLflow run `run_id`; a file that names another run is started anew."""

    def __init__(self, path: Path, run_id: str):
        self.path = path
        held = read(path, run_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a" if held is not None else "w", encoding="utf-8")
        if held is None:
            self._file.write(json.dumps({"mlflow_run_id": run_id}) + "\n")
        elif not path.read_bytes().endswith(b"\n"):  # a line cut short by a kill: the next one starts on its own
            self._file.write("\n")
        self._pending: list[tuple[int, int, dict[str, float]]] = []
        self._lock = threading.Lock()  # the writer's thread writes `stored` lines

    def add(self, step: int, ms: int, metrics: dict[str, float]) -> None:
        self._pending.append((step, ms, metrics))
        if len(self._pending) >= _WRITE_AT:
            self.write_out()

    def write_out(self) -> None:
        """Everything added so far, handed to the operating system (no fsync: a killed process loses none of it)."""
        with self._lock:
            if self._file.closed:
                return
            pending, self._pending = self._pending, []
            self._file.write("".join(json.dumps({"step": s, "time": ms, "metrics": m}) + "\n" for s, ms, m in pending))
            self._file.flush()

    def call(self, kind: str, args: dict, op: str | None = None) -> str:
        """A store call the writer makes later, on disk now; its op id (`op`: the call it replaces)."""
        op = op or uuid.uuid4().hex[:16]
        self._line({"op": op, "call": kind, "args": args})
        return op

    def stored(self, op: str) -> None:
        """The store holds call `op` (from the writer's thread, also after the run ended)."""
        self._line({"done": op})

    def _line(self, record: dict) -> None:
        text = json.dumps(record) + "\n"
        with self._lock:
            if self._file.closed:  # the writer confirms a call after the run's end
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(text)
                return
            self._file.write(text)
            self._file.flush()

    def close(self, status: str | None = None) -> None:
        """Written out and closed; `status`: the run ended so."""
        self.write_out()
        with self._lock:
            if not self._file.closed:
                if status is not None:
                    self._file.write(json.dumps({"status": status}) + "\n")
                self._file.close()


def ended(path: Path, run_id: str) -> str | None:
    """The status the run ended with, if its journal at path says it ended (its last line but the
    confirmations of calls the writer stored after the end)."""
    try:
        with open(path, "rb") as f:
            first = f.readline()
            f.seek(max(0, f.seek(0, 2) - 65536))
            tail = f.read().splitlines()[1:] or [b""]
        if json.loads(first).get("mlflow_run_id") != run_id:
            return None
        for line in reversed(tail):
            entry = json.loads(line) if line.strip() else {}
            if "done" not in entry:
                return entry.get("status")
        return None
    except (OSError, ValueError, AttributeError, IndexError):
        return None


def confirm(path: Path, op: str) -> None:
    """Call `op` of the journal at path is stored (by a process other than the run's)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"done": op}) + "\n")


def calls(path: Path, run_id: str) -> list[tuple[str, str, dict]]:
    """The store calls of the journal at path (of MLflow run run_id) the store never confirmed, in the
    order they were made: (op id, kind, args)."""
    made: dict[str, tuple[str, dict]] = {}
    done: set[str] = set()
    for entry in _lines(path, run_id) or []:
        if "op" in entry and isinstance(entry.get("args"), dict):
            made[entry["op"]] = (str(entry["call"]), entry["args"])  # a later line replaces it, in its place
        elif "done" in entry:
            done.add(entry["done"])
    return [(op, kind, args) for op, (kind, args) in made.items() if op not in done]


def _lines(path: Path, run_id: str) -> list[dict] | None:
    """The journal's entries after its first line, if it belongs to run_id; a line cut short is left out."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        if not lines or json.loads(lines[0]).get("mlflow_run_id") != run_id:
            return None
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    entries = []
    for line in lines[1:]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def read(path: Path, run_id: str) -> list[tuple[int, int, dict[str, float]]] | None:
    """The metric entries of the journal at path if it belongs to MLflow run run_id (None otherwise). A
    line cut short by a kill mid-write, the last one, is left out."""
    entries = _lines(path, run_id)
    if entries is None:
        return None
    out = []
    for entry in entries:
        try:
            out.append((int(entry["step"]), int(entry["time"]), dict(entry["metrics"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out
