"""A real one-host SLURM cluster for the tests: its own munged (own key and socket), one slurmctld and two
slurmd with their own node names (node1, node2: `NodeHostname=localhost`, each on its own port), all
configured by one slurm.conf in a temporary directory that `SLURM_CONF` names. Nothing of the machine's
own SLURM or munge setup is read or changed, and everything started here is stopped at the end.

Two partitions share both nodes: `debug` (the default) and `high`, whose jobs preempt debug's, which is how a
test preempts a job for real. Preemption there is PreemptMode=CANCEL with a GraceTime, as on many clusters:
SLURM sends SIGTERM to the job's steps (srun's tasks; not to the batch shell) at once, SIGKILL when the grace
ends, and never requeues the job by itself.

`slurm_cluster` (session scoped) skips the calling test with one line where the binaries are missing or
the daemons do not start (.ci/run installs slurm-wlm and munge by apt).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
NODES = ("node1", "node2")
GRACE_S = 30  # a preempted job's time between SIGTERM and SIGKILL

SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
LaunchParameters=use_interactive_step
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime={grace}
PartitionName=high Nodes={node_names} Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


@dataclass
class SlurmCluster:
    root: Path                      # slurm.conf, state, spool dirs, logs
    conf: Path                      # what SLURM_CONF names
    env: dict = field(default_factory=dict)  # the environment every slurm command (and so every job) runs in
    nodes: tuple = NODES
    grace_s: int = GRACE_S

    def command(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def sbatch(self, *args: str, cwd: Path | str | None = None, env: dict | None = None) -> int:
        """Submits a job; its id."""
        out = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                             capture_output=True, text=True, timeout=60)
        if out.returncode:
            raise AssertionError(f"sbatch {' '.join(args)}: {out.stderr.strip()}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job`'s fields (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.command("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job_id: int, states: tuple = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                 "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"),
             timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] in states:
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {self.job(job_id)['JobState']} after {timeout:g} s "
                             f"(slurmctld log: {self.root / 'slurmctld.log'})")

    def log(self) -> str:
        return (self.root / "slurmctld.log").read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(daemons: list, name: str, argv: list[str], env: dict, root: Path, ready, timeout: float = 20) -> None:
    """Starts a daemon in the foreground, as our child (so we stop and reap it), and waits until `ready()`."""
    err_file = root / f"{name.replace(' ', '').replace('-', '_')}.stderr"
    with open(err_file, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
    daemons.append(proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = err_file.read_text(errors="replace").strip().splitlines()
            raise RuntimeError(f"{name} exited with {proc.returncode}: {lines[-1] if lines else 'no message'}")
        if ready():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name} not ready within {timeout:g} s")


def start_cluster(root: Path, daemons: list) -> SlurmCluster:
    """Starts munged, slurmctld and the slurmd of each node under `root` (their processes appended to
    `daemons`, which stop_cluster stops); raises RuntimeError with one line saying what did not start."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)  # munged refuses a key or socket directory others may write
    munge = root / "munge"
    munge.mkdir(mode=0o700, exist_ok=True)
    key = munge / "munge.key"
    subprocess.run(["mungekey", "--create", "--keyfile", str(key), "--force"], check=True, capture_output=True)
    os.chmod(key, 0o600)
    munge_socket = munge / "munge.socket.2"
    _daemon(daemons, "munged", ["munged", "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
                                f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                                f"--seed-file={munge / 'munged.seed'}"], os.environ, root, munge_socket.exists)
    for d in ("state", "spool"):
        (root / d).mkdir(exist_ok=True)
    ports = {n: _free_port() for n in NODES}
    nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} CPUs=2 "
                      f"Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN"
                      for n in NODES)
    for n in NODES:
        (root / "spool" / n).mkdir(exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(cluster=f"t{os.getpid()}", ctld_port=_free_port(), munge_socket=munge_socket,
                                      root=root, nodes=nodes, node_names=",".join(NODES), grace=GRACE_S))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # a test run inside a job: not that job's
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(root, conf, env)
    _daemon(daemons, "slurmctld", ["slurmctld", "-D", "-f", str(conf)], env, root,
            lambda: cluster.command("scontrol", "ping", check=False).stdout.count("UP") > 0)
    for n in NODES:
        _daemon(daemons, f"slurmd -N {n}", ["slurmd", "-D", "-f", str(conf), "-N", n], env, root,
                lambda: (root / f"slurmd-{n}.pid").exists())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = cluster.command("sinfo", "-h", "-N", "-o", "%N %t", "-p", "debug", check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        if out.returncode == 0 and len(states) == len(NODES) and all(s == "idle" for s in states.values()):
            return cluster
        time.sleep(0.3)
    raise RuntimeError(f"the nodes did not come up idle within 30 s (sinfo: {out.stdout.strip() or out.stderr.strip()}; "
                       f"logs in {root})")


def stop_cluster(root: Path, daemons: list) -> None:
    """Stops the daemons started under `root`, its jobs first (slurmd ends the job steps it runs)."""
    conf = root / "slurm.conf"
    if conf.exists() and len(daemons) > 1:
        env = {**os.environ, "SLURM_CONF": str(conf)}
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=10)
            if jobs.stdout.strip():
                subprocess.run(["scancel", "--quiet", *jobs.stdout.split()], env=env, capture_output=True, timeout=10)
                _wait_for_no_jobs(env)
    munged = daemons[:1]
    for group in (daemons[1:], munged):  # slurm's daemons, then munge
        for proc in group:
            if proc.poll() is None:
                proc.terminate()
        for proc in group:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    daemons.clear()


def _wait_for_no_jobs(env: dict, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
        if not set(jobs.stdout.split()) & {"RUNNING", "COMPLETING", "PENDING", "CONFIGURING", "SUSPENDED"}:
            return
        time.sleep(0.3)


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The one-host cluster, started once per test session; tests submit jobs with `slurm_cluster.sbatch`."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"no SLURM on this machine ({', '.join(missing)} not found; apt install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("a one-host SLURM cluster needs root (slurmd runs jobs as their user)")
    root, daemons = tmp_path_factory.mktemp("slurm"), []
    try:
        cluster = start_cluster(root, daemons)
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        stop_cluster(root, daemons)
        pytest.skip(f"the one-host SLURM cluster did not start: {e}")
    try:
        yield cluster
    finally:
        stop_cluster(root, daemons)
