"""The study's Optuna storage as every process of a sweep names and opens it (the sweep, and each
job that reports to its trial), and what the sweeper writes into it for the jobs."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from .database import database_problem, masked_url  # noqa: F401 - masked_url: this module's callers name it here
from .hook import SweepConfigError

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

PRUNER_ATTR = "runner.pruner"  # study user attr: the pruner's config (a _target_ dict), for jobs to build it
_RDB_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql", "cockroachdb")


def storage_url(storage: str | Path) -> str:
    """The storage as a string every process can open: a relative journal path or sqlite file
    becomes absolute. (The sweeper resolves `storage: null` to a journal in the sweep directory.)"""
    storage = str(storage)
    if storage.startswith("sqlite:///") and not storage.startswith("sqlite:////") and ":memory:" not in storage:
        return "sqlite:///" + str(Path(storage[len("sqlite:///"):]).resolve())
    if "://" in storage or storage.startswith(tuple(s + ":" for s in _RDB_SCHEMES)):
        return storage
    return str(Path(storage).expanduser().resolve())


def check_storage(url: str) -> None:
    """One line (SweepConfigError) for a storage that cannot be opened as named, before anything starts."""
    if "://" not in url:
        return  # a journal file: its directory is made on open
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme not in (*_RDB_SCHEMES, "redis"):
        raise SweepConfigError(f"hydra.sweeper.storage: {url!r} has an unknown scheme {scheme + '://'!r}; use a journal "
                               "file path, sqlite:///<file>, postgresql://, mysql:// or redis://")
    if scheme == "sqlite" and url.startswith("sqlite:///") and ":memory:" not in url:
        directory = Path(url[len("sqlite:///"):].split("?", 1)[0]).parent
        if not directory.is_dir():
            raise SweepConfigError(f"hydra.sweeper.storage: {url}: the directory {directory} does not exist; create it, "
                                   "or name a journal file (a path without a scheme, made on first use)")
    if scheme != "sqlite" and scheme in _RDB_SCHEMES:
        problem = database_problem(url)
        if problem is not None:
            raise SweepConfigError(f"hydra.sweeper.storage: {problem}")


CLAIM_BEAT_S = 1.0  # how often a claim's maker stamps it while it makes the value
CLAIM_SILENT_S = 10.0  # a claim not stamped for this long (by the waiter's own clock) lost its maker


def once_per_study(storage: "str | BaseStorage", study_name: str, attr: str, make: Callable[[], str],
                   usable: Callable[[str], bool] = lambda value: True,
                   silent_s: float = CLAIM_SILENT_S) -> tuple[str, bool]:
    """The study's user attr `attr`, made by `make` in exactly one of the sweep processes that share the
    study, however they race (runner's hook: the study's one MLflow parent run); (value, made here).

    A user attr is read-then-written, which two processes can interleave; creating a study is atomic in
    every storage (a unique name), so the maker is whoever creates the claim study `<study>:<attr>:<n>`:
    it makes the value, stores it, and deletes the claim; the others wait for the value. The maker stamps
    its claim every CLAIM_BEAT_S with its host and process: a waiter takes the claim over (creates claim
    n+1) once that process is gone (same host) or its stamp has not changed for `silent_s` seconds
    (another host's maker, or a stopped one: a live maker on this host keeps its claim however late its
    beat, as under a heavy load, where a missed beat made a second parent run). Only Optuna's public API: create_study, load_study,
    Study.user_attrs / set_user_attr, get_all_study_names, delete_study. `usable` rejects a stored value
    that no longer works (a deleted run): it is made again, under a claim."""
    import optuna

    study = optuna.load_study(study_name=study_name, storage=storage)
    prefix = f"{study_name}:{attr}:"
    seen: dict[str, tuple[Any, float]] = {}  # claim -> (its stamp as last read, when this process first read it)
    while True:
        value = study.user_attrs.get(attr)
        if value is not None and usable(value):
            return value, False
        claims = sorted(int(n[len(prefix):]) for n in optuna.get_all_study_names(storage)
                        if n.startswith(prefix) and n[len(prefix):].isdigit())
        if claims and not _claim_lost(storage, prefix + str(claims[-1]), seen, silent_s):
            time.sleep(0.2)
            continue
        generation = claims[-1] + 1 if claims else 0
        try:
            claim = optuna.create_study(study_name=prefix + str(generation), storage=storage)
        except optuna.exceptions.DuplicatedStudyError:
            continue  # another waiter took it over first
        stop = _stamp(claim)
        try:
            value = study.user_attrs.get(attr)  # stored by a maker that finished between the read and the claim
            if value is not None and usable(value):
                return value, False
            value = make()
            study.set_user_attr(attr, value)
            return value, True
        finally:
            stop()
            for n in range(generation + 1):  # this claim, and the lost ones it took over
                try:
                    optuna.delete_study(study_name=prefix + str(n), storage=storage)
                except KeyError:
                    pass


def _stamp(claim: Any) -> Callable[[], None]:
    """Stamp the claim with this process (host, pid, its start) and a beat every CLAIM_BEAT_S, on a
    thread, until the returned function is called."""
    import threading

    # one attr, written at once: a waiter never reads a pid without its start
    claim.set_user_attr("owner", {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_started(os.getpid())})
    stop = threading.Event()

    def beat() -> None:
        count = 0
        while True:
            try:
                claim.set_user_attr("beat", count)
            except Exception:  # noqa: BLE001 - a storage hiccup: the next beat tries again
                pass
            count += 1
            if stop.wait(CLAIM_BEAT_S):
                return

    thread = threading.Thread(target=beat, daemon=True, name="claim-beat")
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join()
    return stopped


def _claim_lost(storage: Any, name: str, seen: dict[str, tuple[Any, float]], silent_s: float) -> bool:
    """Whether the claim's maker is gone: its process ended (on this host), or its stamp stood still for silent_s."""
    import optuna

    try:
        attrs = optuna.load_study(study_name=name, storage=storage).user_attrs
    except KeyError:
        return False  # deleted meanwhile: the value is stored, or the next look finds a newer claim
    owner = attrs.get("owner") or {}
    if owner.get("host") == socket.gethostname() and owner.get("pid") is not None:
        if _process_started(int(owner["pid"])) != owner["started"]:
            return True  # the pid is gone (or names a newer process)
        if _process_state(int(owner["pid"])) not in (None, "T", "t"):
            return False  # alive and not stopped: a late beat is a busy machine, not a lost maker
    stamp, now = (owner.get("pid"), attrs.get("beat")), time.monotonic()
    if name not in seen or seen[name][0] != stamp:
        seen[name] = (stamp, now)
        return False
    return now - seen[name][1] > silent_s


def _process_state(pid: int) -> Optional[str]:
    """The process's state letter from /proc (R, S, D, T for stopped, ...); None where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _process_started(pid: int) -> Optional[str]:
    """The process's start (clock ticks after boot, from /proc) while it runs and is no zombie; None once it
    is gone. Where /proc is missing, "alive" for any pid that answers signal 0."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "alive"
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def open_storage(url: str) -> "BaseStorage":
    """An Optuna storage from `storage_url`'s string: RDB URLs, redis:// journals, else a journal file."""
    import optuna
    from optuna.storages import journal

    if url.startswith("redis://"):
        return journal.JournalStorage(journal.JournalRedisBackend(url))
    if "://" in url or url.startswith(tuple(s + ":" for s in _RDB_SCHEMES)):
        return _rdb_storage(url)
    path = Path(url)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JournalNotWritable(path, e) from None
    return journal.JournalStorage(_journal_file(str(path)))


def _rdb_storage(url: str) -> "BaseStorage":
    """Optuna's RDBStorage. Sweep processes started together on a fresh database all create Optuna's
    tables at once, and all but one fail on what the winner made ("type studydirection already exists",
    a duplicate version row): once made, the tables are simply opened, so such a process tries again."""
    import random

    import optuna
    import sqlalchemy

    for attempt in range(10):
        try:
            return optuna.storages.RDBStorage(url)
        except sqlalchemy.exc.DBAPIError as e:
            text = str(e).lower()
            if attempt == 9 or not any(w in text for w in ("already exists", "duplicate", "unique constraint")):
                raise
            time.sleep(0.1 + random.random() * 0.4)
    raise AssertionError("unreachable")


class JournalNotWritable(SweepConfigError):
    """The journal file cannot be made or appended to (a read-only or full disk): one line, not Optuna's traceback."""

    def __init__(self, path: Path | str, error: OSError) -> None:
        super().__init__(f"hydra.sweeper.storage: cannot write the journal file {path} ({error.strerror or error}); "
                         "free space, or name a journal file on a writable disk with hydra.sweeper.storage=<file>")


def _journal_file(path: str):
    """Optuna's journal file backend, its write errors raised as JournalNotWritable."""
    return _journal_class()(path)


_classes: dict[str, type] = {}


def _journal_class() -> type:
    """The backend class, made on first use (optuna is imported only when a sweep runs); a module attribute
    (`_Journal`, see __getattr__) so that a storage pickled into another process finds it there."""
    if "_Journal" not in _classes:
        from optuna.storages.journal import JournalFileBackend

        class _Journal(JournalFileBackend):
            def __init__(self, file_path: str, *args, **kwargs) -> None:
                try:
                    super().__init__(file_path, *args, **kwargs)
                except OSError as e:
                    raise JournalNotWritable(file_path, e) from None

            def append_logs(self, logs: list) -> None:
                try:
                    super().append_logs(logs)
                except OSError as e:
                    raise JournalNotWritable(self._file_path, e) from None

        _Journal.__module__, _Journal.__qualname__ = __name__, "_Journal"
        _classes["_Journal"] = _Journal
    return _classes["_Journal"]


def __getattr__(name: str):
    if name == "_Journal":
        return _journal_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
