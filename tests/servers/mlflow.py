"""A real `mlflow server` for a test: on a free port of 127.0.0.1, its backend a sqlite store (a copy of a
migrated one), its artifacts served from a folder of the test's, in a process group of its own (SIGSTOP
and SIGKILL reach its workers too). `restarted` starts it again on the same port and store, as a server
back from an outage. Skips the test with a one-line reason where it does not start; never outlives it."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path, template: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A fresh server with an empty store in root: (its URI, its process)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, root / "server.db")
    with restarted(root, free_port()) as started:
        yield started


@contextlib.contextmanager
def restarted(root: Path, port: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """The server of root's store (root/server.db, root/artifacts) on `port`: (its URI, its process)."""
    uri = f"http://127.0.0.1:{port}"
    log = open(root / "server.log", "a")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/server.db",
                             "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port",
                             str(port), "--workers", "1"], stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (root / "server.log").read_text().strip().splitlines()[-1:]
                    pytest.skip(f"mlflow server did not start on port {port}: {tail}")
                time.sleep(0.5)
        yield uri, proc
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """The server and its workers killed (continued first where stopped), and reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
