"""Checkpoints under faults: corrupt, truncated, foreign and hostile files are refused in one line; a run
directory falls back to its previous good checkpoint; kills, NaNs and full disks never leave a bad file."""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from runner.engine import checkpoint
from runner.engine.checkpoint import CheckpointWriteError, NonFiniteCheckpoint
from runner.specs.run import RunSpec, SpecError
from tests.conftest import compose_spec, run_cli

HEADER = checkpoint._HEADER_LEN


def trained_state(steps: int = 3) -> dict:
    """Real model and Adam state after a few steps, as the engine puts them into a checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(32, 8)), torch.randint(0, 3, (32,))).backward()
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": checkpoint.rng_state(),
            "progress": {"step": steps, "epoch": 0}}


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def refused(path: Path, reason: str) -> str:
    """The one-line message of a refused checkpoint; asserts it names the file and the reason."""
    with pytest.raises(SpecError) as info:
        checkpoint.load(path)
    message = str(info.value)
    assert message.splitlines() == [message]
    assert message.startswith(f"trainer.resume: {path} is not a valid runner checkpoint (")
    assert reason in message
    return message


def flip(path: Path, offset: int, count: int = 1) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_round_trips_exactly(tmp_path: Path) -> None:
    state = trained_state()
    path = checkpoint.save(tmp_path, 3, state, keep=2)
    assert path.read_bytes().startswith(b"runner checkpoint 1\nsha256 ")
    assert_same(checkpoint.load(path), state)
    assert_same(checkpoint.load(tmp_path), state)
    assert checkpoint.resolve(tmp_path) == path and os.path.samefile(path, tmp_path / "last.pt")


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict]:
    state = trained_state()
    return checkpoint.save(tmp_path / "checkpoints", 3, state, keep=2), state


def test_64_flipped_bytes_in_the_adam_state_are_refused(saved: tuple[Path, dict]) -> None:
    path, state = saved
    exp_avg_sq = state["optimizer"]["state"][0]["exp_avg_sq"]
    offset = path.read_bytes().find(exp_avg_sq.numpy().tobytes())
    assert offset > HEADER
    flip(path, offset, 64)
    # without the checksum torch.load takes the file and the Adam state is silently wrong (the bug)
    with open(path, "rb") as f:
        f.seek(path.read_bytes().find(b"PK\x03\x04", HEADER))
        silent = torch.load(f, weights_only=True)
    assert not torch.equal(silent["optimizer"]["state"][0]["exp_avg_sq"], exp_avg_sq)
    refused(path, "checksum mismatch: the file is corrupt or truncated")


FLIPS = {  # where: (offset from the start, or from the end when negative; the reason given)
    "magic": (3, "no runner checkpoint header: not written by runner.engine.checkpoint.save"),
    "digest": (30, "its header is corrupt or truncated"),
    "sizes": (HEADER - 3, "its header is corrupt or truncated"),
    "meta": (HEADER + 2, "checksum mismatch"),
    "zip header": (HEADER + 40, "checksum mismatch"),
    "middle": (0.5, "checksum mismatch"),
    "zip directory": (-60, "checksum mismatch"),
    "last byte": (-1, "checksum mismatch"),
}


@pytest.mark.parametrize("where", FLIPS)
def test_a_flipped_byte_anywhere_is_refused(saved: tuple[Path, dict], where: str) -> None:
    path, _ = saved
    size = path.stat().st_size
    offset, reason = FLIPS[where]
    flip(path, int(size * offset) if isinstance(offset, float) else offset % size)
    refused(path, reason)


def test_a_digest_that_is_still_hex_but_wrong_is_refused(saved: tuple[Path, dict]) -> None:
    path, _ = saved
    data = bytearray(path.read_bytes())
    at = len(b"runner checkpoint 1\nsha256 ")
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    path.write_bytes(bytes(data))
    refused(path, "checksum mismatch")


@pytest.mark.parametrize("length", [0, 7, HEADER - 1, HEADER, HEADER + 10, 0.5, -1])
def test_a_truncated_file_is_refused(saved: tuple[Path, dict], length: float) -> None:
    path, _ = saved
    data = path.read_bytes()
    keep = int(len(data) * length) if isinstance(length, float) else (len(data) + length if length < 0 else length)
    path.write_bytes(data[:keep])
    reason = {0: "the file is empty", 7: "no runner checkpoint header", HEADER - 1: "header is corrupt or truncated"}
    refused(path, reason.get(length, f"{keep} bytes where its header says {len(data)}"))


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save(trained_state(), plain)
    refused(plain, "no runner checkpoint header: a plain torch.save file")
    text = tmp_path / "notes.pt"
    text.write_text("model: mlp\nsteps: 10\n")
    refused(text, "no runner checkpoint header: not written by runner.engine.checkpoint.save")
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(SpecError, match="no checkpoint in"):
        checkpoint.load(tmp_path / "empty_run")


class RunsCode:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_pickle_that_runs_code_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "the code ran"
    evil = pickle.dumps(RunsCode(marker))
    pickle.loads(evil)  # the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()

    raw = tmp_path / "raw.pt"
    raw.write_bytes(evil)
    refused(raw, "no runner checkpoint header")
    # the same code inside a well-formed checkpoint whose checksum matches: weights_only refuses it
    wrapped = checkpoint.save(tmp_path / "wrapped", 1, {"model": {}, "extra": RunsCode(marker)}, keep=1)
    assert not marker.exists()
    refused(wrapped, "it holds objects other than tensors and plain containers")
    assert checkpoint.read_spec(wrapped) is None  # the meta record is read without unpickling anything
    assert not marker.exists()


def test_a_run_directory_falls_back_to_its_previous_good_checkpoint(tmp_path: Path, caplog) -> None:
    states = {step: trained_state(step) for step in (1, 2, 3)}
    for step, state in states.items():
        checkpoint.save(tmp_path / "checkpoints", step, state, keep=3)
    newest = tmp_path / "checkpoints" / "step-00000003.pt"
    flip(newest, newest.stat().st_size // 2, 64)

    with caplog.at_level(logging.WARNING, logger="runner.engine.checkpoint"):
        path, state = checkpoint.load_latest_good(tmp_path)
    assert path.name == "step-00000002.pt"
    assert_same(state, states[2])
    assert_same(checkpoint.load(tmp_path), states[2])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and str(newest) in warnings[0] and "checksum mismatch" in warnings[0]
    refused(newest, "checksum mismatch")  # a file named explicitly never falls back
    assert checkpoint.verify(tmp_path) == path
    with pytest.raises(SpecError, match="checksum mismatch"):
        checkpoint.verify(newest)

    for step in (1, 2):
        flip(tmp_path / "checkpoints" / f"step-{step:08d}.pt", HEADER + 100)
    with pytest.raises(SpecError) as info:
        checkpoint.load(tmp_path)
    assert str(info.value).splitlines() == [str(info.value)]
    assert str(info.value).startswith(f"trainer.resume: no valid checkpoint in {tmp_path}: all 3 refused")


def test_read_spec_returns_the_spec_of_a_real_checkpoint(tmp_path: Path) -> None:
    spec = compose_spec(["optimizer=adamw", "trainer.max_steps=7"], tmp_path / "run")
    text = spec.to_yaml()
    path = checkpoint.save(tmp_path / "run" / "checkpoints", 7, {**trained_state(), "spec": text}, keep=2)
    assert checkpoint.read_spec(path) == text
    assert checkpoint.read_spec(tmp_path / "run") == text
    assert checkpoint.load(path)["spec"] == text
    assert RunSpec.from_yaml(checkpoint.read_spec(path)) == spec
    assert checkpoint.read_spec(checkpoint.save(tmp_path / "bare", 1, trained_state(), keep=1)) is None
    flip(path, path.stat().st_size - 5)
    with pytest.raises(SpecError, match="checksum mismatch"):
        checkpoint.read_spec(path)


KILLED_SAVE = """
import os, sys, time, torch
from pathlib import Path
from runner.engine import checkpoint
os.fsync = lambda fd: time.sleep(600)  # the temporary file is written; the kill comes before the rename
checkpoint.save(Path(sys.argv[1]), 2, {"model": {"w": torch.ones(100_000)}}, keep=2)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_its_debris_is_removed(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    first = trained_state()
    checkpoint.save(directory, 1, first, keep=2)
    env = {**os.environ, "PYTHONPATH": str(Path(checkpoint.__file__).parents[2])}
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(directory)], env=env)
    orphan = directory / f".step-00000002.pt.tmp-{child.pid}"
    deadline = time.monotonic() + 120
    while not (orphan.exists() and orphan.stat().st_size > 400_000) and child.poll() is None:
        assert time.monotonic() < deadline, "the child never started saving"
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert orphan.exists() and not (directory / "step-00000002.pt").exists()

    assert_same(checkpoint.load(tmp_path), first)  # resume: the previous checkpoint, and the debris is gone
    assert not orphan.exists()


def test_save_removes_temporary_files_of_dead_processes_only(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        names = {f".step-00000009.pt.tmp-{dead_pid}": False, f".last.pt.tmp-{dead_pid}": False,
                 f".step-00000009.pt.tmp-{alive.pid}": True, f".step-00000008.pt.tmp-{os.getpid()}": True,
                 f".last.pt.tmp-{dead_pid}x": True, "notes.txt": True}
        for name in names:
            (tmp_path / name).write_bytes(b"partial")
        checkpoint.save(tmp_path, 10, trained_state(), keep=2)
        assert {name: (tmp_path / name).exists() for name in names} == names
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("where, bad, key", [
    ("model", float("nan"), "model.2.weight"),
    ("optimizer", float("inf"), "optimizer.state.1.exp_avg_sq"),
])
def test_a_non_finite_state_is_never_written(tmp_path: Path, device: str, where: str, bad: float, key: str) -> None:
    good = checkpoint.save(tmp_path, 1, trained_state(), keep=2)
    before = hashlib.sha256(good.read_bytes()).hexdigest()
    state = trained_state()
    state = {k: (_to(v, device) if k in ("model", "optimizer") else v) for k, v in state.items()}
    target = state["model"]["2.weight"] if where == "model" else state["optimizer"]["state"][1]["exp_avg_sq"]
    target.view(-1)[-1] = bad
    with pytest.raises(NonFiniteCheckpoint) as info:
        checkpoint.save(tmp_path, 2, state, keep=2)
    message = str(info.value)
    assert message == f"checkpoint of step 2 not written: {key} holds NaN or inf (the previous checkpoint is kept)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step-00000001.pt"]
    assert hashlib.sha256((tmp_path / "last.pt").read_bytes()).hexdigest() == before


DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_floating_dtype_is_checked(tmp_path: Path, dtype: torch.dtype) -> None:
    weight = torch.linspace(-3, 3, 50).to(dtype)
    ints = {"step": torch.tensor(7), "empty": torch.empty(0, dtype=dtype), "scalar": torch.tensor(2.0).to(dtype)}
    checkpoint.save(tmp_path, 1, {"model": {"w": weight, **ints}}, keep=2)  # finite: written
    weight[17] = float("nan")
    with pytest.raises(NonFiniteCheckpoint, match="model.w holds NaN or inf"):
        checkpoint.save(tmp_path, 2, {"model": {**ints, "w": weight}}, keep=2)
    assert not (tmp_path / "step-00000002.pt").exists()


def _to(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj


def test_a_full_disk_raises_one_line_and_leaves_nothing_partial(tmp_path: Path) -> None:
    good = checkpoint.save(tmp_path, 1, trained_state(), keep=2)
    # the temporary file of the next save is made to land on /dev/full: the kernel answers ENOSPC
    (tmp_path / f".step-00000002.pt.tmp-{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(CheckpointWriteError) as info:
        checkpoint.save(tmp_path, 2, trained_state(), keep=2)
    assert str(info.value) == f"disk full while writing {tmp_path / 'step-00000002.pt'}"
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step-00000001.pt"]
    assert os.path.samefile(good, tmp_path / "last.pt")


@contextmanager
def unprivileged():
    """File permissions bind root only after it drops its effective uid (reversibly) to nobody."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_an_unwritable_directory_raises_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    with pytest.raises(CheckpointWriteError) as info:
        checkpoint.save(blocker / "checkpoints", 1, trained_state(), keep=2)
    assert str(info.value) == f"cannot write checkpoint {blocker / 'checkpoints'}: not a directory"

    locked = tmp_path / "locked"
    checkpoint.save(locked, 1, trained_state(), keep=2)
    locked.chmod(0o555)
    try:
        with unprivileged(), pytest.raises(CheckpointWriteError) as info:
            checkpoint.save(locked, 2, trained_state(), keep=2)
    finally:
        locked.chmod(0o755)
    # the directory itself, or the file in it, depending on whether nobody may search the temp dir's parents
    assert re.fullmatch(rf"cannot write checkpoint {re.escape(str(locked))}(/step-00000002\.pt)?: permission denied",
                        str(info.value)), str(info.value)
    assert sorted(p.name for p in locked.iterdir()) == ["last.pt", "step-00000001.pt"]


@pytest.mark.slow  # a full CLI start (~20 s on a shared CPU)
def test_the_cli_refuses_a_corrupt_checkpoint_in_one_line(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "old" / "checkpoints", 5, trained_state(), keep=2)
    flip(path, path.stat().st_size // 2, 64)
    proc = run_cli([f"trainer.resume={path}", "tracking=none", "trainer.max_steps=10"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: trainer.resume: {path} is not a valid runner checkpoint "
                     "(checksum mismatch: the file is corrupt or truncated)"], proc.stderr
