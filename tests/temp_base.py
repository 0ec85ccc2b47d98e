"""The suite's own base temporary directory (a pytest plugin: tests/conftest.py loads it).

A light module of its own (no import of runner or Hydra) so that a test can load it alone into a
pytest it starts (`-p tests.temp_base`) and check it cheaply.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest

TEMP_BASES = Path(tempfile.gettempdir()) / f"runner-tests-{os.getuid()}"  # one folder per run of the suite below it
KEEP_TEMP_BASES = 3  # finished runs kept for a look at their files, as pytest keeps its last 3


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The suite's own base temporary directory, one per run (unless --basetemp names one): under
    pytest-of-<user>, another pytest on the machine may clean up a directory this run still uses
    (it happened: 321 errors mid-run). A run holds a lock on its folder while it lives; a new run
    removes the older finished ones beyond the newest few."""
    if config.option.basetemp is not None:
        return
    TEMP_BASES.mkdir(mode=0o700, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="run-", dir=TEMP_BASES))
    lock = open(base.with_suffix(".lock"), "w")  # beside the folder: pytest empties the folder itself
    fcntl.flock(lock, fcntl.LOCK_EX)
    config._runner_temp_lock = lock  # held until this process ends
    _remove_old_temp_bases(keep=KEEP_TEMP_BASES)
    config.option.basetemp = str(base)


def _remove_old_temp_bases(keep: int) -> None:
    by_age = sorted(TEMP_BASES.glob("run-*.lock"), key=lambda p: p.stat().st_mtime)
    for lock_path in by_age[:-keep]:
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a run that still lives
            shutil.rmtree(lock_path.with_suffix(""), ignore_errors=True)
            lock_path.unlink()
