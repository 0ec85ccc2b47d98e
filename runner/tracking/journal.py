"""The run directory's copy of every metric the tracker logs: `<run_dir>/metrics.jsonl`.

MLflow gets a run's metrics from a background thread (runner/tracking/writer.py), so a kill (SIGKILL,
the OOM killer, a lost node) can lose what was still queued, and a store that is down for good never
gets them. The journal is what is left then: written by the training process itself, and written out
(to the operating system, which keeps it through the process's death) whenever the tracker flushes,
which the engine does before every checkpoint. So it holds every metric a checkpoint covers, and a
resumed run logs from it what its MLflow run lacks.

One JSON line per log call: {"step": 12, "time": <ms since the epoch>, "metrics": {"train/loss": 0.31}};
the first line names the MLflow run: {"mlflow_run_id": "<id>"}; a run that ended adds its status last:
{"status": "FINISHED"} (a resumed run appends after it, and is no longer ended). A run its process
left RUNNING in the store (killed, or ended while the store was unreachable) is completed from here by
the next runner command that opens the store (runner/tracking/mlflow_store.py, end_orphaned_runs). NaN and infinities are written as
Python's json writes them (NaN, Infinity), which json.loads reads back.
"""
from __future__ import annotations

import json
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

    def add(self, step: int, ms: int, metrics: dict[str, float]) -> None:
        self._pending.append((step, ms, metrics))
        if len(self._pending) >= _WRITE_AT:
            self.write_out()

    def write_out(self) -> None:
        """Everything added so far, handed to the operating system (no fsync: a killed process loses none of it)."""
        if self._file.closed:
            return
        pending, self._pending = self._pending, []
        self._file.write("".join(json.dumps({"step": s, "time": ms, "metrics": m}) + "\n" for s, ms, m in pending))
        self._file.flush()

    def close(self, status: str | None = None) -> None:
        """Written out and closed; `status`: the run ended so."""
        if not self._file.closed:
            self.write_out()
            if status is not None:
                self._file.write(json.dumps({"status": status}) + "\n")
            self._file.close()


def ended(path: Path, run_id: str) -> str | None:
    """The status the run ended with, if its journal at path says it ended (its last line)."""
    try:
        with open(path, "rb") as f:
            first = f.readline()
            f.seek(max(0, f.seek(0, 2) - 200))
            last = f.read().splitlines()[-1:]
        if json.loads(first).get("mlflow_run_id") != run_id or not last:
            return None
        return json.loads(last[0]).get("status")
    except (OSError, ValueError, AttributeError, IndexError):
        return None


def read(path: Path, run_id: str) -> list[tuple[int, int, dict[str, float]]] | None:
    """The entries of the journal at path if it belongs to MLflow run run_id (None otherwise). A line cut
    short by a kill mid-write, the last one, is left out."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        if not lines or json.loads(lines[0]).get("mlflow_run_id") != run_id:
            return None
    except (ValueError, AttributeError):
        return None
    entries = []
    for line in lines[1:]:
        try:
            entry = json.loads(line)
            entries.append((int(entry["step"]), int(entry["time"]), dict(entry["metrics"])))
        except (ValueError, KeyError, TypeError):
            continue
    return entries
