"""Writing a file so that a reader, or a kill at any moment, sees the old file or the whole new one.

The one way runner writes a file another process or a later run reads (checkpoints, best weights, the
k-fold record, PBT's state, the data's caches): into a temporary file beside it, `.<name>.tmp-<pid>` (the
checkpoint directory's cleanup reads the writer's pid from that name), flushed, fsynced and renamed over
it, the directory fsynced so the rename itself survives a power cut.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: Path, content: bytes | str | Callable[[BinaryIO], None]) -> None:
    """Writes `content` (bytes, text as UTF-8, or a function writing into the open binary file) to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(path.parent)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def fsync_directory(directory: Path) -> None:
    """Makes a rename in `directory` durable (POSIX); not every platform can open a directory."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
