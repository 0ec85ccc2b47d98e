"""The study's Optuna storage as every process of a sweep names and opens it (the sweep, and each
job that reports to its trial), and what the sweeper writes into it for the jobs."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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


def open_storage(url: str) -> "BaseStorage":
    """An Optuna storage from `storage_url`'s string: RDB URLs, redis:// journals, else a journal file."""
    import optuna
    from optuna.storages import journal

    if url.startswith("redis://"):
        return journal.JournalStorage(journal.JournalRedisBackend(url))
    if "://" in url or url.startswith(tuple(s + ":" for s in _RDB_SCHEMES)):
        return optuna.storages.RDBStorage(url)
    path = Path(url)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JournalNotWritable(path, e) from None
    return journal.JournalStorage(_journal_file(str(path)))


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
