"""Sharded checkpoint folders across nodes that do not share a disk.

A multi-node run lives in node 0's run directory (README, "Many machines"): another node's run directory holds
nothing needed to resume. torch.distributed.checkpoint assumes the opposite, one folder every rank sees: each rank
writes its own `__<rank>_0.distcp` there and reads any rank's pieces back (a load at another mesh reshards). So
where a rank does not see rank 0's folder, its files travel over the process group, one chunk at a time (no rank
holds more than a chunk of another's files in memory):

- `send_to_rank0`: after a save, a rank that wrote its shards into its own disk's copy of the folder sends them to
  rank 0, which writes them into the folder the manifest then lists;
- `readable_here`: before a load, a rank that does not see the folder (checked by the manifest's SHA-256, not by
  its name: a stale folder of that name may be there) receives a copy of it from rank 0 into a temporary folder
  (under TMPDIR), read and then removed.

The transfers run on a gloo group (the default group where it is gloo): nccl sends no CPU tensors.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

_CHUNK = 1 << 22


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def _transfer_group() -> Iterator[Any]:
    """The default group where it is gloo; else a gloo group for this transfer (every rank enters together)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        yield None
        return
    group = dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def send_to_rank0(folder: Path, senders: dict[int, dict[str, int]]) -> None:
    """Collective after every rank wrote its files of a checkpoint being saved in `folder`: rank 0 receives, into
    it, each sender's files (rank -> {name: bytes}: the ranks that wrote into their own disk's `folder`)."""
    import torch.distributed as dist

    if not senders or not _distributed():
        return
    rank = dist.get_rank()
    with _transfer_group() as group:
        for sender, files in sorted(senders.items()):
            for name, size in sorted(files.items()):
                if rank == 0:
                    _receive(folder / name, size, sender, group)
                elif rank == sender:
                    _send(folder / name, 0, group)


def remove_own_copy(folder: Path) -> None:
    """A rank that sent its files to rank 0: its disk keeps nothing of the checkpoint (nor an empty folder above it,
    where the save made one)."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()  # only when empty: the run's checkpoints folder on a disk it shares stays


@contextlib.contextmanager
def readable_here(folder: Path, manifest: str) -> Iterator[Path]:
    """Collective: a folder holding rank 0's checkpoint `folder` on this rank's disk (itself where this rank sees
    it; else a copy received from rank 0, removed on leaving). `manifest`: the file whose digest names the
    checkpoint (the checkpoint module's; passed in, as that module imports this one)."""
    import torch.distributed as dist

    if not _distributed():
        yield folder
        return
    rank = dist.get_rank()
    box: list[Any] = [_digest(folder / manifest) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    sees = box[0] is not None and _digest(folder / manifest) == box[0]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sees)
    lacking = [r for r, seen in enumerate(every) if not seen]
    if not lacking or box[0] is None:  # rank 0 has no such checkpoint: every rank's reader says so, as it would alone
        yield folder
        return
    copy = None
    try:
        files: list[Any] = [sorted((p.name, p.stat().st_size) for p in folder.iterdir() if p.is_file())
                            if rank == 0 else None]
        dist.broadcast_object_list(files, src=0)
        with _transfer_group() as group:
            if rank == 0:
                for receiver in lacking:
                    for name, _ in files[0]:
                        _send(folder / name, receiver, group)
            elif rank in lacking:
                copy = Path(tempfile.mkdtemp(prefix=f"runner-{folder.name}-rank{rank}-"))
                for name, size in files[0]:
                    _receive(copy / name, size, 0, group)
        yield copy or folder
    finally:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)


def _send(path: Path, to: int, group: Any) -> None:
    import torch.distributed as dist

    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            dist.send(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), dst=to, group=group)


def _receive(path: Path, size: int, sender: int, group: Any) -> None:
    import torch.distributed as dist

    with open(path, "wb") as f:
        left = size
        while left:
            chunk = torch.empty(min(_CHUNK, left), dtype=torch.uint8)
            dist.recv(chunk, src=sender, group=group)
            f.write(chunk.numpy().tobytes())
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
