"""Checkpoints: everything a run needs to continue as if never stopped, written atomically, verified on load.

A checkpoint holds model, optimizer, scheduler, precision (scaler) state, RNG states, step/epoch, the
data position and the run's spec. Two layouts:

- Sharded (what runs write): a folder, `step-<8 digits>.pt/`, holding torch.distributed.checkpoint's files
  (each rank writes its own shards of the model, the optimizer and the add-ons' tensors, `__<rank>_0.distcp`,
  and rank 0 the `.metadata` that maps every tensor's pieces), `record.pt` (rank 0: the spec, progress,
  schedule, monitor, RNG of every rank, ... as plain values, loadable with weights_only=True) and, written
  last, `manifest.json` (step, kind, spec, and each file's size and SHA-256). The folder is written under
  `.<name>.tmp-<pid>` and renamed once every rank has written its shards; a folder without a manifest or
  whose files do not match it is torn and refused with a one-line SpecError. No rank gathers the whole
  state; a checkpoint loads at any mesh (DCP reshards into the loading run's own sharded state dict).
  The folders keep the names of the one-file layout (`step-N.pt`, `best-step-N.pt`, `last.pt`, here a
  symbolic link to the newest), so every path that named a checkpoint names one still.
- One file (written before checkpoints were sharded; still read): a header, a small JSON meta record
  (step, spec), the torch.save payload. `runner checkpoint 1\n` `sha256 <64 hex> meta <10 digits> payload
  <16 digits>\n`. The SHA-256 covers meta and payload and is checked before anything is unpickled.

`load(run_dir)` falls back to the directory's previous good checkpoint when the newest is torn or corrupt
(`load_latest_good` also says which one it used); `load(path)` never falls back. `load` of a sharded folder
reads its tensors whole into this one process (a reader's: eval, export, tests); a training run reads
`read_record` and loads its own shards through runner/engine/parallel/state.py.
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
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

import torch

from runner.files import atomic_write
from runner.engine.rng import rng_state, set_rng_state  # noqa: F401  (part of this module's API)
from runner.specs.run import SpecError

log = logging.getLogger(__name__)
# DCP warns at every save and load in one process that it assumes one process: runner says so itself (no_dist)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

LAST = "last.pt"
TRAINING, WEIGHTS = "training", "weights"  # what a file holds: a run's whole state, or its weights alone
_STEP_FILE = re.compile(r"step-(\d+)\.pt")
_TMP_FILE = re.compile(r"\.(?:step-\d+|best-step-\d+|last)\.pt\.tmp-(\d+)(?:-old)?")  # a file, or a folder being written
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
        _remove(old)
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


def read(path_or_run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """What a training run resumes from, verified (a directory: its newest good checkpoint): a sharded folder's
    record (its tensors stay on disk: each rank loads its own shards), or a one-file checkpoint's whole state."""
    return _use(path_or_run_dir, _read_record_or_state)


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
    if is_folder(path):
        return path
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
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp)
                else:
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
    if path.is_dir():
        return _load_folder(path)
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


def _read_record_or_state(path: Path) -> dict[str, Any]:
    return read_record(path) if path.is_dir() else _read_state(path)


def _read_spec(path: Path) -> str | None:
    return _read_meta(path).get("spec")


def _read_meta(path: Path) -> dict[str, Any]:
    if path.is_dir():
        return _verified_folder(path)
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
    if path.is_dir() and not is_folder(path):
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


# --- sharded checkpoints: one folder, each rank its own shards (torch.distributed.checkpoint) -------------------

MANIFEST, RECORD, DCP_METADATA = "manifest.json", "record.pt", ".metadata"
_FORMAT = "runner sharded checkpoint 1"
MODEL, OPTIM, AVERAGES = "model/", "optim/", "averages/"  # the prefixes of the flat keys DCP stores


def is_folder(path: str | Path) -> bool:
    """Whether `path` is a sharded checkpoint folder, intact or torn (not a run directory holding checkpoints)."""
    path = Path(path)
    return path.is_dir() and (any((path / n).exists() for n in (MANIFEST, RECORD, DCP_METADATA))
                              or any(path.glob("*.distcp")))


class Checkpointer:
    """Writes sharded checkpoints, synchronously or (trainer.async_checkpoint) in a background thread.

    Every rank calls `save` (collective). An asynchronous save copies this rank's tensors to the CPU, returns,
    and writes them while training goes on; it is committed (checksums, manifest, rename, last.pt, rotation)
    when the next save starts or `wait` is called, so a kill before then leaves the previous checkpoint the
    newest. Only one save is in flight at a time."""

    def __init__(self, async_save: bool = False):
        self.async_save = async_save
        self._pending: Callable[[], Path] | None = None
        self._group: Any = None  # a gloo group of its own: the writing thread's collectives never meet training's

    def save(self, target: Path, step: int, tensors: dict[str, Any], record: dict[str, Any] | None, *,
             kind: str = TRAINING, keep: int | None = None) -> Path:
        """Write `tensors` (this rank's flat state: plain tensors or DTensors, keyed model/..., optim/...,
        averages/...) and rank 0's `record` into the folder `target`; with `keep`, `target` is a step checkpoint:
        last.pt points at it and all but the newest `keep` are removed. Returns `target` (asynchronously: the
        folder it will be once committed)."""
        self.wait()
        _refuse_non_finite(tensors, step)
        spec = record.get("spec") if record is not None else None
        if spec is not None and not isinstance(spec, str):
            raise TypeError(f"record['spec'] must be the YAML text of the run spec, not {type(spec).__name__}")
        tmp = self._prepare(target, record)
        from torch.distributed import checkpoint as dcp

        import torch.distributed as dist

        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        alone = not dist.is_initialized()  # one process: said, so DCP does not warn that it assumes so
        # a plain tensor every rank holds is saved once: rank 0's, as the one-file layout did. DCP's default spreads
        # them over the ranks, and a replica's buffers may differ between ranks (ddp's BatchNorm statistics, each
        # rank's own; ddp broadcasts rank 0's): a checkpoint then held rank 1's and a resume diverged from the run
        planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        try:
            if self.async_save:
                future = dcp.async_save(tensors, storage_writer=writer, planner=planner, process_group=self._async_group(),
                                        no_dist=alone)
                self._pending = lambda: (future.result(), _commit(tmp, target, step, kind, keep, spec))[1]
                return target
            dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=alone)
        except OSError as e:
            raise _write_error(e, tmp) from e
        return _commit(tmp, target, step, kind, keep, spec)

    def wait(self) -> Path | None:
        """Commit the save in flight, if any (every rank calls it); returns its folder."""
        pending, self._pending = self._pending, None
        return pending() if pending is not None else None

    def _prepare(self, target: Path, record: dict[str, Any] | None) -> Path:
        """The temporary folder every rank writes into (rank 0 names it after its pid, clears what a killed
        save left, and writes the record there)."""
        import torch.distributed as dist

        main = not dist.is_initialized() or dist.get_rank() == 0
        pid = os.getpid()
        if main:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                remove_orphans(target.parent)
                tmp = target.with_name(f".{target.name}.tmp-{pid}")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                _atomic_write(tmp / RECORD, lambda f: torch.save(record or {}, f))
            except OSError as e:
                pid = -1 if e.errno is None else -e.errno  # every rank raises, not only rank 0
                error = _write_error(e, target)
        if dist.is_initialized():
            box = [pid]
            dist.broadcast_object_list(box, src=0)
            pid = box[0]
        if pid < 0:
            raise error if main else CheckpointWriteError(f"cannot write checkpoint {target} (rank 0 could not)")
        return target.with_name(f".{target.name}.tmp-{pid}")

    def _async_group(self) -> Any:
        import torch.distributed as dist

        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group


def _refuse_non_finite(tensors: dict[str, Any], step: int) -> None:
    """Refuse (on every rank alike) a state whose model or optimizer tensors hold NaN or inf: nothing is written."""
    import torch.distributed as dist

    local = {k: local_tensor(v) for k, v in tensors.items() if k.startswith((MODEL, OPTIM)) and isinstance(v, torch.Tensor)}
    bad = _first_non_finite({"model": local})
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, bad)
        bad = next((b for b in every if b is not None), None)
    if bad is not None:
        name = bad.removeprefix("model.")
        raise NonFiniteCheckpoint(f"checkpoint of step {step} not written: {name} holds NaN or inf "
                                  "(the previous checkpoint is kept)")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _commit(tmp: Path, target: Path, step: int, kind: str, keep: int | None, spec: str | None) -> Path:
    """Every rank hashes its own files; rank 0 writes the manifest, renames the folder into place, links last.pt
    and rotates. Ends with a barrier: every rank returns once the checkpoint is there."""
    import torch.distributed as dist

    from runner.engine import unshared_disks

    rank = dist.get_rank() if dist.is_initialized() else 0
    own = sorted(tmp.glob(f"__{rank}_*.distcp")) + ([tmp / DCP_METADATA, tmp / RECORD] if rank == 0 else [])
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in own}
    # rank 0 wrote the record before any shard: a rank that does not see it wrote into its own disk's copy
    sees_rank0s = rank == 0 or (tmp / RECORD).exists()
    every: list[Any] = [(files, sees_rank0s)]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (files, sees_rank0s))
    unshared_disks.send_to_rank0(tmp, {r: {name: entry["bytes"] for name, entry in part.items()}
                                       for r, (part, seen) in enumerate(every) if not seen})
    files = {k: v for part, _ in every for k, v in part.items()}
    if rank == 0:
        manifest = {"format": _FORMAT, "step": step, "spec": spec, "kind": kind,
                    "ranks": dist.get_world_size() if dist.is_initialized() else 1, "files": files}
        try:
            _atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _replace_folder(tmp, target)
            if keep is not None:
                _atomic_symlink(target, target.parent / LAST)
                for old in _step_files(target.parent)[:-keep]:
                    _remove(old)
        except OSError as e:
            raise _write_error(e, target) from e
    if dist.is_initialized():
        dist.barrier()
    if not sees_rank0s:  # after the barrier: another rank of this node may still have been sending from it
        unshared_disks.remove_own_copy(tmp)
    return target


def _replace_folder(tmp: Path, target: Path) -> None:
    """tmp renamed to target; a folder already there (the same step saved again) is moved aside first."""
    from runner.files import fsync_directory

    old = None
    if target.exists() or target.is_symlink():
        old = target.with_name(f".{target.name}.tmp-{os.getpid()}-old")
        _remove(old)
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_directory(target.parent)
    if old is not None:
        _remove(old)


def _atomic_symlink(target: Path, link: Path) -> None:
    """last.pt names the newest step checkpoint (a relative link: the run directory may move)."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    buffer = memoryview(bytearray(_CHUNK))
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            hasher.update(buffer[:n])
    return hasher.hexdigest()


def _verified_folder(path: Path) -> dict[str, Any]:
    """The manifest of a sharded checkpoint once every file it lists matched its size and checksum."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise InvalidCheckpoint(path, "it has no manifest: the save was interrupted, the folder is torn") from None
    except (OSError, ValueError) as e:
        raise InvalidCheckpoint(path, f"its manifest cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
        raise InvalidCheckpoint(path, "its manifest is not a runner checkpoint's")
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise InvalidCheckpoint(path, f"{name} is missing: the folder is torn")
        if file.stat().st_size != entry["bytes"] or _sha256(file) != entry["sha256"]:
            raise InvalidCheckpoint(path, f"checksum mismatch of {name}: the folder is corrupt or truncated")
    return manifest


def read_record(path: str | Path) -> dict[str, Any]:
    """The record of a sharded checkpoint folder (verified): everything but its tensors."""
    path = Path(path)
    _verified_folder(path)
    return _load_record(path)


def _load_record(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path / RECORD, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise InvalidCheckpoint(path, "its record holds objects other than tensors and plain containers") from None


def tensor_keys(path: str | Path) -> dict[str, Any]:
    """The flat keys a sharded checkpoint holds, with DCP's metadata of each (its global size and dtype)."""
    from torch.distributed import checkpoint as dcp

    return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def read_tensors(path: str | Path, keys: list[str] | None = None) -> dict[str, Any]:
    """Whole (unsharded) tensors of a sharded checkpoint in this one process, whatever mesh wrote them: DCP
    loads into full-size tensors allocated here, with no process group (a reader's path; never collective)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = tensor_keys(path)
    wanted = metadata.keys() if keys is None else keys
    state: dict[str, Any] = {}
    for key in wanted:
        meta = metadata[key]
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
    if state:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return state


def iter_model_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors of a sharded checkpoint one at a time, whole (export streams them into one file)."""
    for key in tensor_keys(path):
        if key.startswith(MODEL):
            yield key[len(MODEL):], read_tensors(path, [key])[key]


def _load_folder(path: Path) -> dict[str, Any]:
    """A sharded checkpoint as the one-file layout holds one: the record, the model's and optimizer's state and
    the averages' values, whole tensors in this process."""
    _verified_folder(path)
    state = _load_record(path)
    state.update(expand(read_tensors(path), state))
    return state


def expand(flat: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Flat model/optim/averages keys as the one-file layout nests them: model, optimizer (state and the
    record's param_groups) and the averages' values in the record's add-on entry."""
    model = {k[len(MODEL):]: v for k, v in flat.items() if k.startswith(MODEL)}
    optim_state: dict[str, dict] = {}
    for k, v in flat.items():
        if k.startswith(OPTIM):
            name, _, field = k[len(OPTIM):].rpartition("/")
            optim_state.setdefault(name, {})[field] = v
    out: dict[str, Any] = {"model": model}
    if "optimizer_groups" in record:
        out["optimizer"] = {"state": optim_state, "param_groups": record["optimizer_groups"]}
    def with_values(averages: dict) -> dict:
        return {kind: {**entry, "values": {k[len(f"{AVERAGES}{kind}/"):]: v for k, v in flat.items()
                                          if k.startswith(f"{AVERAGES}{kind}/")}}
                for kind, entry in averages.items() if entry is not None}

    if (record.get("addons") or {}).get("averages"):  # a step checkpoint: one entry per add-on
        out["addons"] = {**record["addons"], "averages": with_values(record["addons"]["averages"])}
    if record.get("averages"):  # a best checkpoint keeps its averages at the top, as the one-file best files did
        out["averages"] = with_values(record["averages"])
    return out


def load_weights(path: str | Path) -> dict[str, Any]:
    """A checkpoint's record with the model's and the averages' whole tensors in this one process (not the
    optimizer's): what eval, predict, export, log_model and model.weights read. A one-file checkpoint: its state."""
    path = Path(path)
    if not path.is_dir():
        return load(path)
    _verified_folder(path)
    state = _load_record(path)
    keys = [k for k in tensor_keys(path) if k.startswith((MODEL, AVERAGES))]
    state.update(expand(read_tensors(path, keys), {k: v for k, v in state.items() if k != "optimizer_groups"}))
    return state


def copy(source: Path, directory: Path, changes: dict[str, Any], keep: int) -> Path:
    """The checkpoint `source` (a verified sharded folder) as a step checkpoint of `directory`, its record's
    `changes` applied (PBT's exploit: another member's state under this member's MLflow run). The shard files
    are hard-linked where the file system allows (no copy of the state), copied otherwise; the record and the
    manifest are new; committed like a save (temporary name, rename, last.pt, rotation)."""
    manifest = _verified_folder(source)
    record = {**_load_record(source), **changes}
    target = directory / source.name
    directory.mkdir(parents=True, exist_ok=True)
    remove_orphans(directory)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name in manifest["files"]:
            if name == RECORD:
                continue
            try:
                os.link(source / name, tmp / name)
            except OSError:
                shutil.copyfile(source / name, tmp / name)
        _atomic_write(tmp / RECORD, lambda f: torch.save(record, f))
        files = {**manifest["files"], RECORD: {"bytes": (tmp / RECORD).stat().st_size, "sha256": _sha256(tmp / RECORD)}}
        _atomic_write(tmp / MANIFEST, json.dumps({**manifest, "files": files}, indent=1).encode())
        _replace_folder(tmp, target)
        _atomic_symlink(target, directory / LAST)
        for old in _step_files(directory)[:-keep]:
            _remove(old)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(e, target) from e
    return target
