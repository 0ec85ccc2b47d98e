"""A real PostgreSQL 15 server for the tests: initdb into a temporary directory, `postgres` on a free
127.0.0.1 port, started once per test session (module `postgres_server`, a fixture), stopped and its
directory removed at the end. PostgreSQL refuses to run as root, so as root the server runs as an
unprivileged user (`postgres` where the package made one, else `nobody`). A test gets a database of its
own (`fresh_database`) and a URL for it; where initdb is missing or the server cannot start, the test
is skipped with one line saying why.

    def test_x(postgres_database: str): ...   # postgresql://runner@127.0.0.1:<port>/<a fresh database>
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SEARCHED = ("/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/14/bin",
            "/usr/local/pgsql/bin")
SUPERUSER = "runner"


def _binaries() -> Path | None:
    for directory in SEARCHED:
        if (Path(directory) / "initdb").exists() and (Path(directory) / "pg_ctl").exists():
            return Path(directory)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _unprivileged_user() -> str | None:
    """Whom the server runs as: None for the current user, when that is not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One server: `url(database)` names a database on it, `create_database()` makes a fresh one."""

    def __init__(self, bin_dir: Path, root: Path, user: str | None) -> None:
        self.bin_dir, self.root, self.user = bin_dir, root, user
        self.data, self.port = root / "data", _free_port()

    def _as_user(self, args: list[str]) -> list[str]:
        return ["runuser", "-u", self.user, "--", *args] if self.user else args

    def _run(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self._as_user(args), capture_output=True, text=True, timeout=timeout, cwd=self.root)

    def start(self) -> str | None:
        """None once it accepts connections, else the one-line reason it did not start."""
        if self.user:
            info = pwd.getpwnam(self.user)
            os.chown(self.root, info.pw_uid, info.pw_gid)
        init = self._run([str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", SUPERUSER, "--auth=trust",
                          "-E", "UTF8", "--no-sync"], timeout=120)
        if init.returncode != 0:
            return f"initdb failed: {(init.stderr.strip().splitlines() or ['?'])[-1]}"
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        started = self._run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"),
                             "-o", options, "-w", "-t", "60", "start"], timeout=90)
        if started.returncode != 0:
            log = (self.root / "server.log")
            tail = log.read_text().strip().splitlines()[-1:] if log.exists() else [started.stderr.strip()]
            return f"postgres did not start on port {self.port}: {tail[0] if tail else '?'}"
        return None

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def url(self, database: str = "postgres", driver: str = "") -> str:
        return f"postgresql{'+' + driver if driver else ''}://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name


def start_server() -> Iterator[PostgresServer]:
    """A started server for the caller's lifetime (a generator, for a fixture); skips with one line where it cannot run."""
    bin_dir = _binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed here (no initdb/pg_ctl; .ci/run installs postgresql)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg (the extra runner[postgres]) is not installed")
    user = _unprivileged_user()
    if os.geteuid() == 0 and user is None:
        pytest.skip("running as root with no unprivileged user (postgres, nobody) to run PostgreSQL as")
    root = Path(tempfile.mkdtemp(prefix="runner-pg-", dir="/tmp"))
    server = PostgresServer(bin_dir, root, user)
    try:
        reason = server.start()
        if reason is not None:
            pytest.skip(f"PostgreSQL could not start: {reason}")
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    yield from start_server()


@pytest.fixture
def postgres_database(postgres_server: PostgresServer) -> str:
    """The URL of a fresh, empty database on the session's server (plain postgresql://, psycopg 3)."""
    return postgres_server.url(postgres_server.create_database())


def wait_until(predicate, timeout: float, every: float = 0.2) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()
