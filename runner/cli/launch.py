"""From a composed config to a finished run: build the spec, write spec.yaml, run the engine."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
import yaml

from runner.specs import components, resume

from runner.engine import checkpoint, preemption, resume_source

from runner.cli import lifetime, preflight_model, process_state, run_lock
from runner.cli.preflight_device import check_devices, check_processes
from runner.engine.engine import Engine, RunResult, pick_device
from runner.engine.monitor import Diverged
from runner.cli.run_dir import latest_run
from runner.engine.parallel import DistEnv, broadcast_object, in_torchrun, init_process_group, nominal_world
from runner.specs import composition
from runner.specs.parallelism import ParallelismSpec
from runner.engine.parallel.context import check_context_parallel
from runner.specs.run import RunSpec, SpecError
from runner.tracking.tracker import Tracker, build_tracker, check_tracking, end_left_running
from runner.search.trial import open_trial, parent_run_id, pruned

if TYPE_CHECKING:
    from runner.cli import rendezvous

log = logging.getLogger(__name__)

RESULT_FILE = "result.yaml"  # rank 0's RunResult, for the launcher that started the workers
PRUNED_FILE = "pruned"       # rank 0's note that an Optuna pruner stopped the run
DIVERGED_FILE = "diverged"   # rank 0's one-line account of a loss that stopped being finite
WORKER_MMAP_THRESHOLD = 64 * 1024  # bytes: a CPU worker's allocations from this size up are mapped (see launch_workers)


def run(spec: RunSpec) -> RunResult:
    """Run one spec: in this process, or, for ddp/fsdp outside torchrun, in workers started here.
    Whatever the job sets process-wide is undone when it ends (a multirun runs its jobs in one process)."""
    # a new run's own directory, which a refusal removes: not a run continued in place, not a directory that held a
    # spec before this command (a run killed before its first checkpoint), not a sweep's job (its log says why)
    new = ((spec.mode != "train" or not spec.trainer.resume) and not (Path(spec.run_dir) / "spec.yaml").exists()
           and not _in_multirun())
    try:
        with process_state.isolated() as start_state, preemption.handled(requeue=_requeues_its_slurm_job(spec)):
            if spec.mode != "train":  # eval, predict, export: a trained run's model, in this process
                from runner.results import modes

                return modes.run(spec)
            return _run(spec, start_state)
    except SpecError:
        if new and run_lock.decides(spec.parallelism):  # refused: nothing of the run is left to get in the way
            run_lock.remove_refused(Path(spec.run_dir))
        raise


def _requeues_its_slurm_job(spec: RunSpec) -> bool:
    """trainer.slurm_requeue, where the SLURM job is this run's own: a single run, or one job of Hydra's submitit
    launcher (a SLURM job per job), not one of a multirun's jobs that share its process and its SLURM job."""
    if not spec.trainer.slurm_requeue or "SLURM_JOB_ID" not in os.environ:
        return False
    if not _in_multirun():
        return True
    from hydra.core.hydra_config import HydraConfig

    return "submitit" in str(HydraConfig.get().launcher.get("_target_", ""))


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run(spec: RunSpec, start_state: dict) -> RunResult:
    if spec.trainer.resume == "latest":
        spec = spec.replace(trainer=dataclasses.replace(spec.trainer, resume=str(latest_run())))
    if not spec.trainer.resume and run_lock.requeued(Path(spec.run_dir)):  # a requeued SLURM job goes on in place
        spec = spec.replace(trainer=dataclasses.replace(spec.trainer, resume=spec.run_dir))
    key = "trainer.resume" if spec.trainer.resume else "hydra.run.dir"
    # another node without a shared disk does not hold the run it resumes: it runs the command's own spec (the
    # same command on every node) and rank 0, on node 0, reads the checkpoint for every rank
    if spec.trainer.resume and (run_lock.decides(spec.parallelism) or (Path(spec.trainer.resume) / "spec.yaml").exists()
                                or Path(spec.trainer.resume).is_file() or checkpoint.is_folder(spec.trainer.resume)):
        # the callbacks typed now with their defaults filled in, as the saved spec holds them: like with like
        spec = resume_source.plan(components.resolved_callbacks(spec))
    # the model's and dataset's arguments checked against their callables, defaults filled in: spec.yaml
    # is then the fully resolved record
    spec = components.resolved_spec(spec, resume.typed_keys(spec.overrides))
    run_dir = Path(spec.run_dir)
    _hold_for_tests()
    # One process group per run directory, held by one process, which alone decides whether this run may use
    # it (under torchrun rank 0, for every rank; on several nodes, node 0's launcher). Another node's launcher
    # neither checks nor writes spec.yaml there (a shared directory would show it node 0's fresh run).
    with _decided(run_dir, key, run_lock.decides(spec.parallelism)):
        return _run_owned(spec, run_dir, start_state)


def _hold_for_tests() -> None:
    """RUNNER_TEST_HOLD_DECISION=<rank>:<seconds>: the process of that RANK (a launcher: 0) waits before the run
    directory is decided, so a test orders the ranks (or nodes) as a race would, rather than hoping for it."""
    rank, _, seconds = os.environ.get("RUNNER_TEST_HOLD_DECISION", "").partition(":")
    if rank and rank == os.environ.get("RANK", "0"):
        import time

        time.sleep(float(seconds))


@contextlib.contextmanager
def _decided(run_dir: Path, key: str, decides: bool) -> Iterator[None]:
    """The run directory held by the deciding process, for the run; under torchrun (the group formed when rank 0
    named the directory: runner/cli/run_dir.py) every other rank waits for rank 0's decision and, refused, raises
    the same one line: checking for itself, it could see the spec.yaml rank 0 had just written."""
    refusal = None
    with contextlib.ExitStack() as held:
        if decides:
            try:
                held.enter_context(run_lock.owned(run_dir, key))
                if key == "hydra.run.dir":  # a new run: refuses a directory that holds an old one
                    run_lock.refuse_existing_run(run_dir)
            except SpecError as e:
                refusal = str(e)
        if in_torchrun() and torch.distributed.is_initialized():
            refusal = broadcast_object(refusal)
        if refusal is not None:
            raise SpecError(refusal)
        yield


def _run_owned(spec: RunSpec, run_dir: Path, start_state: dict) -> RunResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    if spec.tracking.name != "none" and os.environ.get("RANK", "0") == "0":
        check_tracking(spec.tracking)  # a store that cannot answer: one line now, before torch builds anything
    if spec.trainer.cross_validation.folds and spec.trainer.cross_validation.fold is None:
        from runner.search import cross_validation

        return cross_validation.run_folds(spec, run_dir, run_one=run)  # K runs, each started as this one would be
    par = spec.parallelism
    # single with tp/pp/cp > 1 is one model replica on tp x pp x cp processes: started as ddp/fsdp's are
    if (par.name != "single" or nominal_world(par) > 1) and not in_torchrun():
        return launch_workers(spec)
    env = init_process_group(pick_device(spec.trainer.device).type) if in_torchrun() else DistEnv()
    check_processes(spec)  # preflight's check of torchrun's processes, for a sweep's later jobs
    if env.is_main:
        (run_dir / "spec.yaml").write_text(spec.to_yaml())
        # the process state the job started from: equal for every job, and recorded to reproduce it
        (run_dir / "process_state.yaml").write_text(yaml.safe_dump(process_state.describe(start_state)))
    return run_in_process(spec, env)


def run_in_process(spec: RunSpec, env: DistEnv) -> RunResult:
    # the store opens in the background while the engine builds (runner/tracking/tracker.py): in the tracking
    # process, but where this process imported MLflow already or runs a multirun's jobs (one import for them all)
    where = "thread" if _in_multirun() or "mlflow" in sys.modules else "process"
    tracker = build_tracker(spec, env.rank, parent_run_id=parent_run_id(spec), open_now=where)
    if spec.tune.name:  # a finder's answer, applied, turns the finder off: a resume finds it on only while it
        # never finished (it runs again) or when tune.apply=false (the answer recorded in the run directory is reported)
        from runner import tune

        spec, tracker = tune.run_finder(spec, env, tracker)
        if spec is None:  # tune.apply=false: found and reported, nothing to train
            return tune.NOTHING_TRAINED
    engine = build_engine(spec, tracker, env)
    result = engine.fit()
    if result.pruned:
        raise pruned(result.pruned)  # how a job tells the sweeper its trial was pruned
    if env.is_main:
        (Path(spec.run_dir) / RESULT_FILE).write_text(yaml.safe_dump(dataclasses.asdict(result)))
        print_summary(spec, result, engine.tracker.describe())
    return result


def build_engine(spec: RunSpec, tracker: Tracker, env: DistEnv | None = None) -> Engine:
    """A run's engine as the CLI builds it: an Optuna trial's run reports each validation to its trial and
    asks its pruner, through the trial's add-on (runner/search/trial.py)."""
    trial = open_trial(spec)
    return Engine(spec, tracker, env, addons=[trial] if trial is not None else [])


def launch_workers(spec: RunSpec) -> RunResult:
    """torch's elastic agent (what torchrun runs) starts nproc_per_node workers on this node; each
    reads spec.yaml, so Hydra composed once and every rank shares this run directory."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from runner.cli import rendezvous  # torch's elastic rendezvous: imported only by a run that starts workers

    check_parallel(spec)
    spec = spec.replace(parallelism=on_cluster(spec.parallelism))
    for note in (PRUNED_FILE, DIVERGED_FILE, RESULT_FILE, run_lock.REFUSED_FILE):  # a resumed run directory: the last attempt's notes
        (Path(spec.run_dir) / note).unlink(missing_ok=True)
    par = spec.parallelism
    # node 0's is the run's spec.yaml; another node's workers read their own copy (a shared run directory has one
    # spec.yaml, and it names node 0)
    spec_path = Path(spec.run_dir) / ("spec.yaml" if par.node_rank == 0 else f".spec-node-{par.node_rank}.yaml")
    spec_path.write_text(spec.to_yaml())
    multi_node = par.nnodes > 1
    nproc = nominal_world(par) // par.nnodes  # nproc_per_node; under single, tp x pp x cp
    rendezvous.register()
    rendezvous.current = None  # an earlier job's (a multirun runs its jobs in one process)
    config = LaunchConfig(
        min_nodes=par.nnodes, max_nodes=par.nnodes, nproc_per_node=nproc,
        run_id=f"runner-{par.rdzv_endpoint}" if multi_node else f"runner-{uuid.uuid4().hex[:8]}",
        rdzv_backend=rendezvous.BACKEND, rdzv_endpoint=par.rdzv_endpoint if multi_node else "127.0.0.1:0",
        rdzv_configs={"join_timeout": par.rdzv_timeout, "read_timeout": max(1, int(par.rdzv_timeout)),
                      "is_host": par.node_rank == 0, rendezvous.NODE_RANK_PARAM: par.node_rank,
                      rendezvous.RUN_DIR_PARAM: spec.run_dir},
        max_restarts=par.max_restarts, monitor_interval=0.2, start_method="spawn")
    os.environ[lifetime.LAUNCHER_PID_ENV] = str(os.getpid())  # the workers end with this process (runner/cli/lifetime.py)
    if pick_device(spec.trainer.device).type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # as torchrun does: workers sharing the CPU must not each start a thread per core
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if pick_device(spec.trainer.device).type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # A worker's tensors live in glibc's heap on a CPU. Its dynamic mmap threshold rises to the largest block
        # freed (FSDP's all-gathered blocks, the tied 50257 x 768 embedding's gradient, the reduce-scatter
        # buffers), after which every such tensor comes from the heap, and freed heap memory stays resident:
        # measured on GPT-2 under fsdp on 2 ranks, each rank peaked at 3.0 GiB with it, 2.2 GiB with a fixed
        # 64 KiB threshold (tensors of 64 KiB and more mapped and unmapped, returned as they are freed). The
        # step time it costs is in README's "Per-rank memory". A user's own setting is kept.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(WORKER_MMAP_THRESHOLD)
    # the mesh as resolved (-1 taken, the preset's degrees): hsdp's or tp's layout is said here, not only typed
    mesh = " x ".join(f"{d}={n}" for d, n in composition.degrees(par).items() if n > 1) or "one replica"
    log.info("starting %d workers on this node (%d node%s), parallelism=%s: %s", nproc, par.nnodes,
             "s" if multi_node else "", par.name, mesh)
    try:
        # torch's agent raises SignalException from its SIGTERM/SIGHUP handler: one a finalizer drops would leave
        # the launcher waiting on workers that never heard of the signal
        with _refusals_left_to_the_launcher(spec.run_dir), preemption.raised_again_when_dropped(agent_signal):
            elastic_launch(config, entrypoint=sys.executable)("-m", "runner.cli.worker", str(spec_path))
    except ChildFailedError as e:
        end_left_running(spec, "FAILED")
        diverged = Path(spec.run_dir) / DIVERGED_FILE
        if diverged.exists():
            raise Diverged(diverged.read_text()) from None
        refused = Path(spec.run_dir) / run_lock.REFUSED_FILE
        if refused.exists():  # input a worker refused (found where the engine is built): one line, exit 2, as in one process
            raise SpecError(refused.read_text()) from None
        raise WorkersFailed(_group_failure(spec, e)) from None
    except KeyboardInterrupt:
        end_left_running(spec, "KILLED")
        raise
    except SignalException as e:  # the agent forwarded SIGTERM/SIGHUP; the workers stopped at a step boundary
        if not (Path(spec.run_dir) / RESULT_FILE).exists():
            end_left_running(spec, "KILLED")
            raise preemption.Stopped(int(e.sigval)) from None
        log.warning("signal %d after the run finished: it stays FINISHED, nothing to stop", int(e.sigval))  # rank 0's result
    except SpecError:  # the rendezvous refused this node (runner/cli/rendezvous.py): its one line
        end_left_running(spec, "FAILED")
        raise
    except Exception as e:  # rendezvous errors: the other nodes or the endpoint never answered
        end_left_running(spec, "FAILED")
        if multi_node and rendezvous.current is not None and rendezvous.current.roll_call is not None:
            # the nodes trained together: one was lost since
            roll_call = rendezvous.current.roll_call
            raise WorkersFailed(_lost_node(spec, roll_call.lost_nodes(), roll_call, restarting=True)) from None
        if "Rendezvous" in type(e).__name__ or "DistStore" in type(e).__name__ or "timed out" in str(e).lower():
            raise SpecError(f"parallelism.rdzv_endpoint: no rendezvous at {par.rdzv_endpoint} within {par.rdzv_timeout:g} s "
                            f"(waited for {par.nnodes} nodes to join); check the address, the port, and that every node "
                            "was started") from None
        raise
    finally:
        if rendezvous.current is not None and rendezvous.current.roll_call is not None:
            rendezvous.current.roll_call.stop()
    preemption.run_finished()  # the workers ended the run: a signal now leaves it as they did
    pruned = Path(spec.run_dir) / PRUNED_FILE
    if pruned.exists():
        import optuna

        raise optuna.TrialPruned(pruned.read_text())
    result_file = Path(spec.run_dir) / RESULT_FILE
    if not result_file.exists():  # global rank 0 ran on another node
        return RunResult(math.nan, {}, {}, {}, 0, 0.0)
    return RunResult(**yaml.safe_load(result_file.read_text()))


def agent_signal(e: BaseException) -> int:
    """The signal whose handler in torch's elastic agent raised `e` (0: not the agent's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return int(e.sigval) if isinstance(e, SignalException) else 0


@contextlib.contextmanager
def _refusals_left_to_the_launcher(run_dir: str) -> Iterator[None]:
    """torch's agent logs how a failed worker group ends ("failed (exitcode: 2) local_rank: 0 (pid ...)", "Sending
    process ... closing signal SIGTERM" to the other workers). A group ended by a worker's refusal of the run's
    input is said by the launcher in the refusal's own line, so those lines are left out for it; any other
    failure keeps them."""
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    refused = Path(run_dir) / run_lock.REFUSED_FILE

    def not_after_a_refusal(record: logging.LogRecord) -> bool:
        return not refused.exists()

    agent_log.addFilter(not_after_a_refusal)
    try:
        yield
    finally:
        agent_log.removeFilter(not_after_a_refusal)


def check_parallel(spec: RunSpec) -> None:
    """What can be known before any worker starts."""
    par = spec.parallelism
    if spec.trainer.resume and run_lock.decides(par):
        resume_source.check_source(spec.trainer.resume)  # a missing or corrupt checkpoint: one error here, not one per worker
    check_devices(spec)  # preflight's check, done already for the command's own spec
    check_context_parallel(spec, pick_device(spec.trainer.device))
    # what the model decides, on the meta device: preflight's check, done already for the command's own spec
    preflight_model.check_model_composition(spec, say=log.warning)


def on_cluster(par: ParallelismSpec) -> ParallelismSpec:
    """rdzv_endpoint `slurm:<port>`: the job's first node hosts the rendezvous; this node's rank is SLURM_NODEID."""
    if not par.rdzv_endpoint.startswith("slurm:"):
        return par
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise SpecError(f"parallelism.rdzv_endpoint: {par.rdzv_endpoint!r} needs a SLURM job (SLURM_JOB_NODELIST is not set); "
                        "give host:port instead")
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True).stdout.split()
    host = hosts[0] if hosts else nodelist.split(",")[0]
    return dataclasses.replace(par, rdzv_endpoint=f"{host}:{par.rdzv_endpoint.split(':', 1)[1]}",
                               node_rank=int(os.environ.get("SLURM_NODEID", 0)))


class WorkersFailed(RuntimeError):
    """A worker died or raised and no restart was left: the message says which and how."""


def _describe_failure(error: Exception) -> str:
    from runner.cli import rendezvous

    failures = getattr(error, "failures", {})
    parts = []
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        how = (f"killed by signal {-code}" if code < 0 else "lost a peer" if code == rendezvous.PEER_GONE_EXIT
               else f"exit code {code}")
        parts.append(f"rank {rank} ({how})")
    return "workers failed: " + (", ".join(parts) or str(error).splitlines()[0])


def _group_failure(spec: RunSpec, error: Exception) -> str:
    """The line for workers that failed with no restart left. On several nodes, workers that only lost a peer
    (PEER_GONE_EXIT) say nothing about their own node: the roll call (runner/cli/rendezvous.py) tells which node
    was lost, or whose workers failed by themselves; workers that failed by themselves tell the other nodes."""
    from runner.cli import rendezvous

    own = _describe_failure(error)
    roll_call = rendezvous.current.roll_call if spec.parallelism.nnodes > 1 and rendezvous.current else None
    if roll_call is None:
        return own
    failures = getattr(error, "failures", {}).values()
    if not failures or any(f.exitcode != rendezvous.PEER_GONE_EXIT for f in failures):
        roll_call.report_failed(f"node {spec.parallelism.node_rank}'s {own}")
        return own
    lost = roll_call.lost_nodes()
    if roll_call.failed:  # another node's own workers failed: its line says why
        return "; ".join(f"{what} (host {roll_call.hosts.get(r, '?')}; its log says why)"
                         for r, what in sorted(roll_call.failed.items()))
    return _lost_node(spec, lost, roll_call, restarting=False) if lost else own


def _lost_node(spec: RunSpec, lost: list[int], roll_call: "rendezvous.RollCall | None", restarting: bool) -> str:
    """One line for a node lost after the nodes had trained together: which (node rank and host, from the roll
    call), after which step (node 0's newest checkpoint: on node 0 its own disk, elsewhere what node 0 last said),
    what is kept and how to go on (node 0's run directory, which holds the run)."""
    par = spec.parallelism
    hosts = roll_call.hosts if roll_call is not None else {}

    def host(r: int) -> str:
        return f" (host {hosts[r]})" if r in hosts else ""

    if len(lost) == 1:
        who = f"node {lost[0]} of {par.nnodes}{host(lost[0])} was"
    elif lost:
        who = "nodes " + ", ".join(f"{r}{host(r)}" for r in lost) + f" of {par.nnodes} were"
    else:
        who = f"a node of {par.nnodes} was"
    node_0_said = roll_call is not None and par.node_rank != 0  # what node 0 posted: its run directory, its newest checkpoint
    run_dir = Path(roll_call.run_dir) if node_0_said and roll_call.run_dir else Path(spec.run_dir)
    if par.node_rank == 0:
        try:
            newest = checkpoint.resolve(spec.run_dir)
        except SpecError:  # no checkpoint was written yet
            newest = None
    else:
        newest = Path(roll_call.kept) if node_0_said and roll_call.kept else None
    if newest is not None:
        match = re.fullmatch(r"step-0*(\d+)\.pt", newest.name)
        kept = (f"after step {match.group(1)} ({newest} is kept" if match else
                f"after its newest checkpoint ({newest} is kept") + ("" if par.node_rank == 0 else " on node 0") + ")"
    elif par.node_rank != 0:  # node 0 had not said (it says every half second): its disk may hold one
        kept = "after its newest checkpoint (kept in node 0's run directory)"
    else:
        kept = "before its first checkpoint (set trainer.checkpoint_every_n_steps)"
    why = (f"did not rejoin within {par.rdzv_timeout:g} s" if restarting else
           "no restart was left (parallelism.max_restarts)")
    return f"{who} lost {kept} and {why}; resume with the same command on every node plus trainer.resume={run_dir}"


def print_summary(spec: RunSpec, result: RunResult, tracking: str) -> None:
    metric = spec.objective.metric
    best_step = f" (step {result.best_step[metric]})" if metric in result.best_step else ""
    final = "  ".join(f"{k} {v:.4f}" for k, v in result.final.items())
    if result.test_from and result.final:  # "best@step 40": the weights the test metrics came from
        kind, _, step = result.test_from.partition("@")
        final += f"  (the {kind} weights, {step})"
    mfu = f"MFU {result.mfu * 100:.3g}%" if result.mfu is not None else "MFU unknown (set trainer.peak_tflops)"
    speed = f"  {result.tflops:.3g} TFLOP/s per device, {mfu}\n" if result.tflops is not None else ""
    # through the logger: the console shows it once and the run log (runner.log) keeps it
    log.info(f"runner: trained {result.steps} optimizer steps in {result.seconds:.1f} s\n"
             f"  best {metric}: {result.objective:.4f}{best_step}\n"
             f"  {final}\n{speed}"
             f"  run directory: {spec.run_dir}\n"
             f"  {tracking}")
