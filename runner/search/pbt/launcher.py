"""PBT's members as jobs of the Hydra launcher the user chose (`hydra/launcher=joblib`, `submitit_local`,
`submitit_slurm`, runner's `slurm`): the sweep hands each round's member jobs to the launcher and reads their
results from the sweep directory, so a population can train on a cluster. Hydra's basic launcher keeps
PBT's own way (runner/search/pbt/population.py: in the sweep's process, or its own subprocesses).

A member's job is the same round runner/search/pbt/member.py runs locally: the launcher composes the sweep's
fixed overrides plus `+pbt_job=<job file>` and calls `member_task`, which runs that file's round. Exploit
copies checkpoints between run directories, so the sweep directory must be one filesystem that the sweep and
every job see (a cluster's shared disk).

Members die with their sweep wherever they run: the sweep keeps `pbt_sweep.alive` in its directory (its
token, host and pid, and a beat it rewrites every second) and removes it when it stops. A member stops, at a
step boundary with its checkpoint and its MLflow run KILLED, as soon as the file is gone or names another
sweep (a rerun took over), when the sweep's process is gone on the sweep's own host (a SIGKILL), or when the
beat stood still for STALE_S on another host. A member that starts after its sweep stopped (a SLURM job
still queued) trains nothing.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from runner.files import atomic_write
from runner.specs.run import SpecError

log = logging.getLogger(__name__)
ALIVE_FILE = "pbt_sweep.alive"
JOB_KEY = "pbt_job"   # the override naming a member's job file
BEAT_S = 1.0          # the sweep rewrites its alive file this often
STALE_S = 60.0        # a beat that stood still this long, seen from another host: the sweep is gone
STOP_WAIT_S = 60.0    # a stopped sweep waits this long for its members to stop (write a checkpoint, end KILLED)
RELAUNCHES = 3        # a member stopped by a signal of its own (a preemption) is launched again this often


class MemberFailed(RuntimeError):
    """A member's job failed (its own error, not a signal): one line naming it and its log."""


def is_basic(launcher: Any) -> bool:
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    return launcher is None or isinstance(launcher, BasicLauncher)


def check(launcher: Any, n_jobs: int) -> None:
    """One line, before anything runs, where the launcher cannot train this population's members: each member
    needs a process of its own (its signal handling and Hydra's job state are per process) that is one task
    (a member trains in one process), and `n_jobs` of them at once."""
    name = type(launcher).__name__
    joblib_settings = getattr(launcher, "joblib", None)
    if type(launcher).__module__.startswith("hydra_plugins.hydra_joblib_launcher") and joblib_settings is not None:
        from joblib import effective_n_jobs

        wanted = joblib_settings.get("n_jobs", -1)
        at_once = effective_n_jobs(wanted)
        if at_once < 2:
            raise SpecError(f"hydra.launcher.n_jobs: {wanted}; joblib then runs every member inside the sweep's own "
                            "process, one after another: leave hydra/launcher at basic for that, or allow 2 or more jobs")
        if at_once < n_jobs:
            raise SpecError(f"hydra.launcher.n_jobs: {wanted} ({at_once} at once); hydra.sweeper.n_jobs={n_jobs} asks "
                            f"{n_jobs} members at once: raise hydra.launcher.n_jobs to {n_jobs}, or lower hydra.sweeper.n_jobs")
        return
    params = getattr(launcher, "params", None)
    if type(launcher).__module__.startswith("hydra_plugins.hydra_submitit_launcher") and isinstance(params, dict):
        for key in ("nodes", "tasks_per_node"):
            if params.get(key, 1) != 1:
                raise SpecError(f"hydra.launcher.{key}: {params[key]}; a PBT member trains in one process, so its job "
                                f"is one task on one node ({name}); allowed: 1")
        parallel = params.get("array_parallelism")
        if parallel is not None and parallel < n_jobs:
            raise SpecError(f"hydra.launcher.array_parallelism: {parallel}; hydra.sweeper.n_jobs={n_jobs} asks {n_jobs} "
                            f"members at once: raise it to {n_jobs}, or lower hydra.sweeper.n_jobs")


class SweepAlive:
    """The sweep's alive file, rewritten every BEAT_S by a thread while the sweep runs, removed when it stops."""

    def __init__(self, sweep_dir: Path):
        self.path = Path(sweep_dir) / ALIVE_FILE
        self.token = uuid.uuid4().hex
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def identity(self) -> dict[str, Any]:
        """What a member's job file carries to watch this sweep."""
        return {"alive": os.path.abspath(self.path), "token": self.token, "host": self.host, "pid": self.pid}

    def _write(self, beat: int) -> None:
        atomic_write(self.path, json.dumps({"token": self.token, "host": self.host, "pid": self.pid, "beat": beat}))

    def start(self) -> SweepAlive:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write(0)

        def beat() -> None:
            n = 0
            while not self._stop.wait(BEAT_S):
                n += 1
                try:
                    self._write(n)
                except OSError as e:  # a full or unreachable disk: members on other hosts stop after STALE_S
                    log.warning("PBT: cannot rewrite %s (%s)", self.path, e)

        self._thread = threading.Thread(target=beat, name="pbt-sweep-alive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """The members stop (they watch the file); only this sweep's own file is removed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


class LauncherMembers:
    """Runs a round's member jobs through `launcher`, `n_jobs` at a time; each job writes its result file."""

    def __init__(self, launcher: Any, fixed: Sequence[str], n_jobs: int, alive: SweepAlive):
        self.launcher, self.fixed, self.n_jobs, self.alive = launcher, list(fixed), n_jobs, alive
        self.launched = 0  # Hydra's job number of the next job

    def job_fields(self) -> dict[str, Any]:
        return {"sweep": self.alive.identity()}

    def __call__(self, jobs: Sequence[Path]) -> None:
        """A member stopped by a signal of its own while the sweep runs (a SLURM preemption, a node drained) is
        launched again, RELAUNCHES times at most: its job goes on from the checkpoint the stop wrote."""
        todo = list(jobs)
        for attempt in range(RELAUNCHES + 1):
            stopped = []
            for start in range(0, len(todo), self.n_jobs):
                stopped += self._launch(todo[start:start + self.n_jobs])
            if not stopped:
                return
            for job, why in stopped:
                if attempt == RELAUNCHES:
                    raise MemberFailed(f"PBT member {_member_of(job)} was stopped {RELAUNCHES + 1} times before the end "
                                       f"of its round (last: {why}); the same command on the same hydra.sweep.dir goes "
                                       "on from its checkpoint")
                log.warning("PBT: member %s was stopped (%s); launching it again from its checkpoint", _member_of(job), why)
            todo = [job for job, _ in stopped]

    def _overrides(self, job: Path) -> list[str]:
        # the job's Hydra directory (its .hydra/ and runner.log) beside its job file, not in the member's run dir
        job = Path(os.path.abspath(job))
        subdir = job.parent.relative_to(Path(os.path.abspath(self.alive.path.parent))) / job.stem
        return [*self.fixed, f"+{JOB_KEY}={_quote(str(job))}", f"hydra.sweep.subdir={_quote(str(subdir))}"]

    def _launch(self, jobs: list[Path]) -> list[tuple[Path, str]]:
        """The launcher's `launch` runs in a thread: a Ctrl-C or SIGTERM of the sweep (raised in this, the main
        thread) then stops the members through the alive file and waits for them, rather than interrupting the
        launcher (joblib's abort would SIGKILL its workers, leaving their MLflow runs RUNNING)."""
        returns: list[Any] = []
        failure: list[BaseException] = []

        def launch() -> None:
            try:
                returns.extend(self.launcher.launch([self._overrides(j) for j in jobs], initial_job_idx=self.launched))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                failure.append(e)

        thread = threading.Thread(target=launch, name="pbt-launch", daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(timeout=0.2)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM/SIGHUP: the members stop with the sweep
            self.alive.stop()
            thread.join(timeout=STOP_WAIT_S)
            raise
        self.launched += len(jobs)
        if failure:
            raise MemberFailed(f"the launcher {type(self.launcher).__name__} could not run the members "
                               f"({type(failure[0]).__name__}: {_first_line(failure[0])})") from None
        return [(job, why) for job, ret in zip(jobs, returns) if (why := _stopped(job, ret))]


def _stopped(job: Path, ret: Any) -> str | None:
    """Why the member's job stopped before the end of its round (a signal), None when it finished; raises
    MemberFailed for a job that failed."""
    from hydra.core.utils import JobStatus

    if ret.status == JobStatus.COMPLETED:
        value = ret.return_value
        return value["stopped"] if isinstance(value, dict) and "stopped" in value else None
    error = ret._return_value
    log_file = Path(str(ret.hydra_cfg.hydra.runtime.output_dir)) / f"{ret.hydra_cfg.hydra.job.name}.log"
    raise MemberFailed(f"PBT member {_member_of(job)} failed ({type(error).__name__}: {_first_line(error)}); "
                       f"its log: {log_file}")


def _member_of(job: Path) -> str:
    return job.parent.parent.name.removeprefix("member-")  # <sweep dir>/member-<id>/pbt/job-<step>.json


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# --- in the member's job -----------------------------------------------------------------------

def member_task(cfg: Any) -> dict[str, Any]:
    """The task function the launcher calls for a member's job: that job file's round, stopped (at a step
    boundary, checkpoint written, MLflow run KILLED) when its sweep stops or dies. Returns the result the job
    also writes, or {"stopped": why}."""
    from runner.engine import preemption
    from runner.search.pbt.member import run_job

    job_file = Path(str(cfg[JOB_KEY]))
    sweep = json.loads(job_file.read_text())["sweep"]
    with preemption.handled():
        gone = sweep_gone(sweep, {})
        if gone:  # queued until after its sweep stopped: nothing to train for
            log.warning("PBT: %s: not trained, %s", job_file, gone)
            return {"stopped": gone}
        watch = _Watch(sweep).start()
        try:
            result = run_job(job_file)
        except preemption.Stopped as e:
            result = {"stopped": str(e)}
        except Exception:
            log.exception("PBT member job %s failed", job_file)  # the traceback in the job's runner.log
            raise
        finally:
            with contextlib.suppress(preemption.Stopped):  # the watcher's signal racing the round's end
                watch.stop()
    return result


def sweep_gone(sweep: dict[str, Any], seen: dict[str, Any]) -> str | None:
    """Why the member's sweep is gone, or None while it runs. `seen`: the watcher's memory of the last beat
    and when (by this host's clock) it changed."""
    try:
        alive = json.loads(Path(sweep["alive"]).read_text())
    except FileNotFoundError:
        return "its sweep stopped"
    except (OSError, ValueError):
        return None  # being replaced, or the disk hiccupped: asked again shortly
    if alive.get("token") != sweep["token"]:
        return "another sweep took over its sweep directory"
    if sweep["host"] == socket.gethostname():
        return None if _process_alive(int(sweep["pid"])) else f"its sweep (process {sweep['pid']}) is gone"
    now = time.monotonic()
    if seen.get("beat") != alive.get("beat"):
        seen.update(beat=alive.get("beat"), at=now)
    elif now - seen["at"] > STALE_S:
        return f"its sweep on {sweep['host']} has not written {sweep['alive']} for {STALE_S:g} s"
    return None


def _process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state != "Z"


class _Watch:
    """A thread that stops this member (SIGTERM to itself: preemption's handler stops the run at the next
    step boundary) once its sweep is gone."""

    def __init__(self, sweep: dict[str, Any], every_s: float = 0.5):
        self.sweep, self.every_s = sweep, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pbt-sweep-watch", daemon=True)

    def start(self) -> _Watch:
        self._thread.start()
        return self

    def _run(self) -> None:
        import signal

        seen: dict[str, Any] = {}
        while not self._stop.wait(self.every_s):
            why = sweep_gone(self.sweep, seen)
            if why:
                log.warning("PBT: stopping this member: %s", why)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def stop(self) -> None:
        """No signal comes after this returns (the member's own handler is about to go)."""
        self._stop.set()
        self._thread.join()
