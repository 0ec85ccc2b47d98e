"""A run directory belongs to one run and, at any moment, to one process group.

Two processes training into one directory (two resumes started at once, or a second run started with
the same `hydra.run.dir`) would write one set of checkpoints and one MLflow run between them. So:

- `owned(run_dir)` holds `<run dir>/.runner.lock` for as long as the run goes on. The lock is an
  flock on the file, which the kernel releases when its holder exits however it exits (SIGKILL
  included): a lock whose process is gone is never in the way. The file names its holder (pid and
  host) for the one-line refusal that a second process gets.
- `refuse_existing_run(run_dir)` stops a new run (no resume) in a directory that already holds one:
  it would reattach to that run's MLflow run, where its params are not logged and its metrics are
  dropped as already seen.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path
from typing import Iterator

from runner.specs.run import SpecError

LOCK_FILE = ".runner.lock"
REFUSED_FILE = "refused"  # a worker's one-line refusal of the run's input, for the launcher to say (runner/cli/worker.py)
# what makes a directory a run's: the spec is written first, before its MLflow run exists
RUN_FILES = ("spec.yaml", "mlflow_run_id", "checkpoints")


@contextlib.contextmanager
def owned(run_dir: Path, key: str) -> Iterator[None]:
    """Hold the run directory for this process group; SpecError (one line, naming `key` and the owner)
    when another process holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise SpecError(f"{key}: cannot write the run directory {run_dir} ({(e.strerror or str(e)).lower()}); "
                        "a run needs a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpecError(f"{key}: the run directory {run_dir} is in use by {describe_owner(run_dir)}; "
                        "wait for that run to end or stop it (it stops at its next step with SIGTERM)") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\nhost {socket.gethostname()}\n".encode())
        yield
    finally:
        # the file stays (removing it would let two processes lock two different files); emptied, it names nobody
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


def check_free(run_dir: Path, key: str) -> None:
    """SpecError when another process holds the run directory (a check only: nothing is written)."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody ever held it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SpecError(f"{key}: the run directory {run_dir} is in use by {describe_owner(run_dir)}; "
                        "wait for that run to end or stop it (it stops at its next step with SIGTERM)") from None
    finally:
        os.close(fd)


def describe_owner(run_dir: Path) -> str:
    try:
        fields = dict(line.split(" ", 1) for line in (run_dir / LOCK_FILE).read_text().splitlines() if " " in line)
    except OSError:
        fields = {}
    if "pid" not in fields:
        return "another process"
    return f"process {fields['pid']} on {fields.get('host', 'an unknown host')}"


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES)


# what a refused run leaves in its new directory: Hydra's record of the command and its log, the spec, the
# process state, the lock, error.txt and a worker's refusal; a directory holding anything else is not removed
REFUSED_RUN_LEFTOVERS = {".hydra", "spec.yaml", "process_state.yaml", LOCK_FILE, "error.txt", REFUSED_FILE}


def remove_refused(run_dir: Path) -> bool:
    """A new run refused before anything of it existed (no MLflow run, no checkpoint): its directory is removed,
    so the corrected command can use it and `trainer.resume=latest` never picks it. True if removed."""
    import shutil

    try:
        names = {p.name for p in run_dir.iterdir()}
    except OSError:
        return False
    if not names <= REFUSED_RUN_LEFTOVERS | {n for n in names if n.endswith(".log")}:
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def requeued(run_dir: Path) -> bool:
    """A SLURM job requeued (preempted, or `scontrol requeue`) reruns its command unchanged: into its own run
    directory, which then holds the run it continues (stopped by SIGTERM at a step, with that step's
    checkpoint), not an old run to refuse."""
    return os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0") and holds_run(run_dir)


def refuse_existing_run(run_dir: Path, key: str = "hydra.run.dir") -> None:
    """A new run (no trainer.resume) into a directory that already holds a run: one line, nothing changed."""
    if holds_run(run_dir):
        raise SpecError(f"{key}: {run_dir} already holds a run; a new run needs its own directory (leave {key} "
                        f"unset or name a new one), and trainer.resume={run_dir} continues that run")


def decides(parallelism: object | None = None) -> bool:
    """Whether this process decides for the run directory (takes it, refuses it, writes spec.yaml): torchrun's
    rank 0, or node 0's launcher (SLURM_NODEID under `rdzv_endpoint=slurm:<port>`). The others follow its
    decision: a check of their own could see what it has just written into a shared directory, and a node
    without a shared disk holds no run to check."""
    if os.environ.get("RANK", "0") != "0":
        return False
    if parallelism is None:
        return True
    if str(getattr(parallelism, "rdzv_endpoint", "")).startswith("slurm:"):
        return os.environ.get("SLURM_NODEID", "0") in ("", "0")
    return getattr(parallelism, "node_rank", 0) == 0


def check_at_start(resume: str | None, dir_key: str, run_dir: str, parallelism: object | None = None) -> None:
    """The CLI's checks before Hydra writes into the run directory: what `trainer.resume` names (a missing,
    corrupt or foreign checkpoint), a resume in place of a run that another process trains, a new run into
    a directory in use or holding a run. Only the process that decides for the run directory checks it."""
    if not decides(parallelism):
        return
    if not resume and dir_key == "hydra.run.dir" and requeued(Path(run_dir)):
        resume = run_dir
    if resume == "latest":
        from runner.cli.run_dir import latest_run

        resume = str(latest_run())
    if resume:
        from runner.engine.resume_source import check_source  # imports torch; a resumed run needs it next anyway

        check_source(resume)
        if Path(resume).is_dir():
            check_free(Path(resume), "trainer.resume")
    elif dir_key == "hydra.run.dir":
        check_free(Path(run_dir), dir_key)
        refuse_existing_run(Path(run_dir).absolute(), dir_key)
