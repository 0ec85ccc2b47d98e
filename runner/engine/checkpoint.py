"""Checkpoints: everything a run needs to continue as if never stopped, written atomically, verified on load.

A checkpoint holds model, optimizer, scheduler, precision (scaler) state, RNG states, step/epoch, the
data position and the run's spec. On disk: a header, a small JSON meta record (step, spec), the
torch.save payload. `runner checkpoint 1\n` `sha256 <64 hex> meta <10 digits> payload <16 digits>\n`.
The SHA-256 covers meta and payload; it is computed while torch.save streams out and checked by streaming
the file back before anything is unpickled (`weights_only=True`), so no side holds a second copy in
memory. Files are written under a temporary name, fsynced and renamed: a crash leaves the previous
checkpoint intact, and a torn or corrupt file is refused with a one-line SpecError.

`load(run_dir)` falls back to the directory's previous good checkpoint when the newest is corrupt
(`load_latest_good` also says which file it used); `load(file)` never falls back.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

import torch

from runner.files import atomic_write
from runner.engine.rng import rng_state, set_rng_state  # noqa: F401  (part of this module's API)
from runner.spec.run import SpecError

log = logging.getLogger(__name__)

LAST = "last.pt"
TRAINING, WEIGHTS = "training", "weights"  # what a file holds: a run's whole state, or its weights alone
_STEP_FILE = re.compile(r"step-(\d+)\.pt")
_TMP_FILE = re.compile(r"\.(?:step-\d+|best-step-\d+|last)\.pt\.tmp-(\d+)")
_MAGIC = b"runner checkpoint 1\n"
_HEADER = re.compile(rb"sha256 ([0-9a-f]{64}) meta (\d{10}) payload (\d{16})\n")
_HEADER_LEN = len(_MAGIC) + len(b"sha256 %s meta %010d payload %016d\n" % (b"0" * 64, 0, 0))
_CHUNK = 1 << 22
T = TypeVar("T")
_warned: set[tuple[str, str]] = set()  # a refused file is reported once per process, however often it is read


class InvalidCheckpoint(SpecError):
    """A file that is not an intact runner checkpoint (corrupt, truncated, empty or foreign)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"trainer.resume: {path} is not a valid runner checkpoint ({reason})")
        self.path, self.reason = path, reason


class NonFiniteCheckpoint(ValueError):
    """save() was given weights or optimizer state holding NaN or inf; nothing was written."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, directory not writable); nothing partial is left."""


def save(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write step-<step>.pt atomically, point last.pt at it, drop all but the newest `keep`.

    Refuses (NonFiniteCheckpoint) before writing anything when a floating tensor of state["model"] or
    state["optimizer"] holds NaN or inf. state["spec"], the YAML text of the run spec, is also kept in
    the file's meta record, so `read_spec` reads it without unpickling the checkpoint.
    """
    path = directory / f"step-{step:08d}.pt"
    write(path, step, state)
    try:
        _atomic_link(path, directory / LAST)
    except CheckpointWriteError:
        path.unlink(missing_ok=True)  # last.pt still names the previous checkpoint, which stays the newest
        raise
    for old in _step_files(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def write(path: Path, step: int, state: dict[str, Any], kind: str = TRAINING) -> Path:
    """One checkpoint file at `path`, atomically, checked as save() checks one (no last.pt link, no
    rotation). `kind` is kept in the meta record: TRAINING (everything a resume needs) or WEIGHTS (a
    run's best weights: model and averages only, which evaluate but cannot continue training)."""
    bad = _first_non_finite(state)
    if bad is not None:
        raise NonFiniteCheckpoint(f"checkpoint of step {step} not written: {bad} holds NaN or inf "
                                  "(the previous checkpoint is kept)")
    spec = state.get("spec")
    if spec is not None and not isinstance(spec, str):
        raise TypeError(f"state['spec'] must be the YAML text of the run spec, not {type(spec).__name__}")
    meta = json.dumps({"step": step, "spec": spec, **({"kind": kind} if kind != TRAINING else {})}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(e, path.parent) from e
    remove_orphans(path.parent)
    _atomic_write(path, lambda f: _write_checkpoint(f, state, meta))
    return path


def verify_kind(path_or_run_dir: str | Path) -> tuple[Path, str]:
    """verify(), and what the file holds (TRAINING or WEIGHTS), from one read; nothing is unpickled."""
    path, meta = _use(path_or_run_dir, _read_meta)
    return path, meta.get("kind", TRAINING)


def is_checkpoint(head: bytes) -> bool:
    """Whether the first bytes of a file are those of a runner checkpoint (its format marker)."""
    return head.startswith(_MAGIC)


def load(path_or_run_dir: str | Path) -> dict[str, Any]:
    """The state of a checkpoint file, or of a run directory's newest good checkpoint (see load_latest_good)."""
    return _use(path_or_run_dir, _read_state)[1]


def load_latest_good(run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of a run directory that passes its checksum, and its state.

    Tries the step files newest first (last.pt only where it is a copy, not a hard link); each refused
    file is logged as a warning naming it.
    """
    return _first_good(Path(run_dir), _read_state)


def read_spec(path_or_run_dir: str | Path) -> str | None:
    """The spec YAML stored in a checkpoint (None when it was saved without one), checksum verified."""
    return _use(path_or_run_dir, _read_spec)[1]


def verify(path_or_run_dir: str | Path) -> Path:
    """The checkpoint file a resume would load, its checksum verified (a directory: its newest good one).
    Nothing is unpickled, so a launcher can refuse a bad file cheaply before any worker starts."""
    return _use(path_or_run_dir, _read_spec)[0]


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether a run directory holds any checkpoint file (good or not)."""
    return bool(_candidates(Path(run_dir)))


def resolve(path_or_run_dir: str | Path) -> Path:
    """A checkpoint file, or a run directory's newest checkpoint file (not verified: see load_latest_good)."""
    path = Path(path_or_run_dir)
    if path.is_dir():
        candidates = _candidates(path)
        if candidates:
            return candidates[0]
        raise SpecError(f"trainer.resume: no checkpoint in {path}; give a checkpoint file or a run directory holding checkpoints/")
    if not path.is_file():
        raise SpecError(f"trainer.resume: {str(path)!r} does not exist; give a checkpoint file or a run directory")
    return path


def remove_orphans(directory: Path) -> list[Path]:
    """Delete temporary files left by saves that were killed (their process is gone); return them."""
    removed = []
    for tmp in directory.glob(".*.pt.tmp-*"):
        match = _TMP_FILE.fullmatch(tmp.name)
        if match and not _alive(int(match.group(1))):
            with contextlib.suppress(OSError):  # a read-only directory: leave it
                tmp.unlink()
                removed.append(tmp)
    if removed:
        log.info("removed %d temporary file(s) of interrupted checkpoint saves in %s", len(removed), directory)
    return removed


def _first_non_finite(state: dict[str, Any]) -> str | None:
    """The key of the first floating tensor of model/optimizer state holding NaN or inf, else None.

    Each tensor's verdict stays on its device and the verdicts are stacked, so a GPU state costs one
    synchronisation per device, not one per tensor.
    """
    tensors = [kt for part in ("model", "optimizer") if part in state for kt in _floating(state[part], part)]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    bad = []
    for indices in by_device.values():
        finite = torch.stack([_finite(tensors[i][1]) for i in indices])
        if not bool(finite.all()):
            bad.append(indices[int((~finite).nonzero()[0])])
    return tensors[min(bad)][0] if bad else None


def _finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on t's device. aminmax reads t once and propagates NaN; on a CPU it is ~10x faster than
    isfinite(t).all(), which first writes a bool copy of t (256 MiB fp32: 0.4 s against 4 s)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    try:
        return torch.isfinite(torch.stack(torch.aminmax(t))).all()
    except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8)
        return torch.isfinite(t.float()).all()


def _floating(obj: Any, key: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and obj.layout == torch.strided:
            yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _floating(v, f"{key}.{k}")
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from _floating(v, f"{key}.{k}")



class _HashingSink:
    """The file object torch.save writes to: hashes and counts what passes through. torch.save calls
    write() from C++, so a failed write is kept and raised once torch.save has returned rather than
    sent through its zip writer."""

    def __init__(self, f: BinaryIO, digest: Any):
        self.f, self.digest, self.count, self.error = f, digest, 0, None

    def write(self, data: Any) -> int:
        if self.error is None:
            try:
                self.f.write(data)
            except OSError as e:
                self.error = e
            self.digest.update(data)
            self.count += memoryview(data).nbytes
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def _write_checkpoint(f: BinaryIO, state: dict[str, Any], meta: bytes) -> None:
    f.write(_MAGIC + b" " * (_HEADER_LEN - len(_MAGIC) - 1) + b"\n")  # filled in once the digest is known
    f.write(meta)
    sink = _HashingSink(f, hashlib.sha256(meta))
    torch.save(state, sink)
    if sink.error is not None:
        raise sink.error
    f.seek(len(_MAGIC))
    f.write(b"sha256 %s meta %010d payload %016d\n" % (sink.digest.hexdigest().encode(), len(meta), sink.count))


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    try:
        atomic_write(path, write)
    except OSError as e:
        raise _write_error(e, path) from e


def _atomic_link(target: Path, link: Path) -> None:
    """last.pt is a hard link to the newest step file: no second copy on disk, replaced atomically."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)
        os.link(target, tmp)
        os.replace(tmp, link)
    except OSError:  # file systems without hard links: a copy, written like any checkpoint
        with contextlib.suppress(OSError):
            tmp.unlink()
        _atomic_write(link, lambda f: _copy_into(target, f))


def _copy_into(source: Path, f: BinaryIO) -> None:
    with open(source, "rb") as src:
        shutil.copyfileobj(src, f, _CHUNK)


def _write_error(e: OSError, path: Path) -> CheckpointWriteError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        error = CheckpointWriteError(f"disk full while writing {path}")
    else:
        error = CheckpointWriteError(f"cannot write checkpoint {path}: {os.strerror(e.errno).lower() if e.errno else e}")
    error.errno = e.errno
    return error


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except PermissionError:  # it does, and belongs to another user
        return True
    except (OSError, OverflowError):
        return False
    return pid > 0


@contextlib.contextmanager
def _verified(path: Path) -> Iterator[tuple[BinaryIO, dict[str, Any]]]:
    """Yield (file, meta) once the whole file matched its checksum; the payload starts at file.tell().

    One open file serves the check and the load, so a checkpoint replaced meanwhile cannot slip in.
    """
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InvalidCheckpoint(path, f"it cannot be read: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEADER_LEN)
        if not head:
            raise InvalidCheckpoint(path, "the file is empty")
        if not head.startswith(_MAGIC):
            kind = "a plain torch.save file" if head.startswith(b"PK") else "not written by runner.engine.checkpoint.save"
            raise InvalidCheckpoint(path, f"no runner checkpoint header: {kind}")
        header = _HEADER.fullmatch(head[len(_MAGIC):])
        if header is None:
            raise InvalidCheckpoint(path, "its header is corrupt or truncated")
        digest, meta_len, payload_len = header.group(1).decode(), int(header.group(2)), int(header.group(3))
        expected = _HEADER_LEN + meta_len + payload_len
        if size != expected:
            raise InvalidCheckpoint(path, f"{size} bytes where its header says {expected}: the file is corrupt or truncated")
        hasher = hashlib.sha256()
        buffer = memoryview(bytearray(_CHUNK))
        while n := f.readinto(buffer):
            hasher.update(buffer[:n])
        if hasher.hexdigest() != digest:
            raise InvalidCheckpoint(path, "checksum mismatch: the file is corrupt or truncated")
        f.seek(_HEADER_LEN)
        try:
            meta = json.loads(f.read(meta_len))
        except ValueError:
            raise InvalidCheckpoint(path, "its meta record is not JSON") from None
        yield f, meta


def _read_state(path: Path) -> dict[str, Any]:
    with _verified(path) as (f, _):
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)  # reads from f.tell() on
        except pickle.UnpicklingError:  # the checksum matched: the file was made to hold code
            raise InvalidCheckpoint(path, "it holds objects other than tensors and plain containers") from None
        except Exception as e:
            raise InvalidCheckpoint(path, f"torch.load failed: {(str(e).strip() or type(e).__name__).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise InvalidCheckpoint(path, f"it holds a {type(state).__name__}, not a checkpoint dict")
    return state


def _read_spec(path: Path) -> str | None:
    with _verified(path) as (_, meta):
        return meta.get("spec")


def _read_meta(path: Path) -> dict[str, Any]:
    with _verified(path) as (_, meta):
        return meta


def _checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir


def _step_files(directory: Path) -> list[Path]:
    """Oldest first, by step number."""
    steps = [(int(m.group(1)), p) for p in directory.glob("step-*.pt") if (m := _STEP_FILE.fullmatch(p.name))]
    return [p for _, p in sorted(steps)]


def _candidates(run_dir: Path) -> list[Path]:
    """The step files, newest first, then last.pt where it is a copy rather than a hard link to one of them."""
    directory = _checkpoint_dir(run_dir)
    paths, seen = [], set()
    for path in [*reversed(_step_files(directory)), directory / LAST]:
        with contextlib.suppress(OSError):
            st = path.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                paths.append(path)
    return paths


def _use(path_or_run_dir: str | Path, read: Callable[[Path], T]) -> tuple[Path, T]:
    """A file is used or refused; a directory falls back to its previous good checkpoint."""
    path = Path(path_or_run_dir)
    if path.is_dir():
        return _first_good(path, read)
    path = resolve(path)
    remove_orphans(path.parent)
    return path, read(path)


def _first_good(run_dir: Path, read: Callable[[Path], T]) -> tuple[Path, T]:
    remove_orphans(_checkpoint_dir(run_dir))
    candidates = _candidates(run_dir)
    if not candidates:
        resolve(run_dir)  # raises its one-line error
    for path in candidates:
        try:
            return path, read(path)
        except InvalidCheckpoint as e:
            if (str(path), e.reason) not in _warned:
                _warned.add((str(path), e.reason))
                log.warning("skipping checkpoint %s (%s); trying the previous one", path, e.reason)
            refused = e
    raise SpecError(f"trainer.resume: no valid checkpoint in {run_dir}: all {len(candidates)} refused, "
                    f"the newest ({refused.path.name}) for {refused.reason}")


# A checkpoint written before the add-ons had one entry each kept theirs at the top: where each was.
_TOP_LEVEL_ADDON_KEYS = {"averages": "averages", "early_stopping": "early_stopping", "overfit_goal": "overfit",
                         "unfreezing": "unfreezer"}


def addon_states(state: dict) -> dict:
    """The add-ons' entries of a checkpoint, by add-on name; read from the old top-level keys in a checkpoint
    written before they had one entry each (its oldest early-stopping state lies in its monitor's)."""
    if "addons" in state:
        return state["addons"]
    old = {name: state.get(key) for name, key in _TOP_LEVEL_ADDON_KEYS.items()}
    old["early_stopping"] = old["early_stopping"] or state.get("monitor")
    return {name: value for name, value in old.items() if value is not None}
