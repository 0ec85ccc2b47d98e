"""A SQLAlchemy database URL (an Optuna RDB storage, an MLflow store) checked before anything opens it:
the driver, the server, the login, in one line with the password masked. Its own module, free of Optuna,
so runner's tracking checks its MLflow store with it without importing the study's storage."""
from __future__ import annotations

import socket
import urllib.parse
from typing import Optional

_DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433, "cockroachdb": 26257, "oracle": 1521}
_CONNECT_TIMEOUT_S = 5
# the pip package that provides a missing driver module; psycopg (3) is what SQLAlchemy 2.1 maps a plain
# postgresql:// to, and what runner's extra runner[postgres] installs
_DRIVER_PACKAGES = {"psycopg": "'psycopg[binary]' (runner's extra: pip install 'runner[postgres]')",
                    "psycopg2": "psycopg2-binary", "pymysql": "pymysql", "MySQLdb": "mysqlclient",
                    "asyncpg": "asyncpg", "pg8000": "pg8000", "pyodbc": "pyodbc", "oracledb": "oracledb"}


def masked_url(url: str) -> str:
    """The URL with its password (if any) shown as ***, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = urllib.parse.quote(urllib.parse.unquote(parts.username or ""), safe="")
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def database_problem(url: str) -> Optional[str]:
    """Why a SQLAlchemy database URL (an Optuna RDB storage, an MLflow store) cannot be used, as one
    line starting with the masked URL and ending with the fix; None when a connection opens. Checks the
    driver SQLAlchemy maps the URL to (postgresql:// is psycopg 3 under SQLAlchemy 2.1; the
    postgresql+psycopg2:// form needs psycopg2), then that a server answers and accepts the login."""
    import sqlalchemy
    from sqlalchemy.engine import make_url

    shown = masked_url(url)
    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except sqlalchemy.exc.NoSuchModuleError:
        return f"{shown}: SQLAlchemy has no driver {url.split('://', 1)[0]!r}; name the database as postgresql://, mysql://, ..."
    except (sqlalchemy.exc.ArgumentError, ValueError) as e:
        return f"{shown} is not a valid database URL ({_first_line(e)})"
    try:
        dialect.import_dbapi()
    except ImportError as e:
        module = (getattr(e, "name", None) or str(e).rsplit(" ", 1)[-1]).strip("'\"").split(".")[0]
        package = _DRIVER_PACKAGES.get(module, module)
        other = (" (or drop '+" + dialect.driver + "' to use psycopg 3: pip install 'runner[postgres]')"
                 if parsed.get_backend_name() == "postgresql" and dialect.driver != "psycopg" else "")
        return (f"{shown}: its driver {module!r} ({parsed.drivername}) is not installed; pip install {package}{other}")
    host, port = parsed.host, parsed.port or _DB_PORTS.get(parsed.get_backend_name())
    if host and port:
        try:
            socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
        except OSError as e:
            return (f"{shown}: no database server answers at {host}:{port} ({_first_line(e)}); start it, or check "
                    "the host and port")
    connect_args = {"connect_timeout": _CONNECT_TIMEOUT_S} if parsed.get_backend_name() in ("postgresql", "mysql") else {}
    try:
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=connect_args)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as e:  # noqa: BLE001 - whatever the driver raises is the reason, in its first line
        cause = getattr(e, "orig", None) or e
        return (f"{shown}: cannot connect ({_first_line(cause)}); check that the database "
                f"{parsed.database!r} exists and the user and password are right")
    return None


def _first_line(error: object) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
