"""One worker of a ddp/fsdp run, started by the elastic agent: `python -m runner.cli.worker <spec.yaml>`.

It reads the spec the launcher wrote (no Hydra here: the spec is the contract), joins the process
group, and runs the engine. After an elastic restart it resumes from the run's newest checkpoint.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist

from runner.engine import checkpoint, preemption
from runner.engine.engine import pick_device
from runner.cli import lifetime
from runner.cli.launch import DIVERGED_FILE, PRUNED_FILE, run_in_process
from runner.cli.rendezvous import PEER_GONE_EXIT
from runner.cli.run_lock import REFUSED_FILE
from runner.engine.monitor import Diverged
from runner.engine.parallel import broadcast_object, gather_objects, init_process_group
from runner.specs.run import RunSpec, SpecError
from runner.search.trial import is_pruned


def main(spec_path: str) -> None:
    # the agent that started this worker runs in runner's launcher (or is torchrun): this worker ends with it
    lifetime.end_with_parent(lifetime.launcher_pid() or os.getppid())
    spec = RunSpec.from_yaml(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", 0))
    # as a Hydra job logs: the console (stdout) and, on rank 0, the run log the launcher also appends to
    handlers = [logging.StreamHandler(sys.stdout)]
    if rank == 0:
        handlers.append(logging.FileHandler(Path(spec.run_dir) / "runner.log"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", handlers=handlers)
    try:
        env = init_process_group(pick_device(spec.trainer.device).type)
        restarts = _rounds_before()
        if restarts:
            # Rank 0 decides for every node (another node's disk may hold other files): after a restart
            # the run goes on from its own newest checkpoint, even when it started from trainer.resume=X.
            own = broadcast_object(_has_checkpoint(spec.run_dir) if env.is_main else None)
            if own:
                logging.getLogger("runner").info("restart %d: resuming from the newest checkpoint in %s", restarts,
                                                 spec.run_dir)
                spec = spec.replace(trainer=dataclasses.replace(spec.trainer, resume=spec.run_dir))
        with preemption.handled():  # every rank stops at one step boundary, its checkpoint written
            run_in_process(spec, env)
        dist.destroy_process_group()  # only after a clean run: with a peer gone it can block
        exit_before_teardown()
    except preemption.Stopped as e:  # the agent forwarded SIGTERM/SIGHUP: exit as the signal would
        sys.exit(e.exit_code)
    except SpecError as e:  # refused input: rank 0's line is the launcher's to say, once, as a refusal (exit 2)
        if rank == 0:
            (Path(spec.run_dir) / REFUSED_FILE).write_text(str(e))
        sys.exit(2)
    except Diverged as e:  # every rank stops at the same step; the launcher tells the user in one line
        if rank == 0:
            (Path(spec.run_dir) / DIVERGED_FILE).write_text(str(e))
        sys.exit(1)
    except RuntimeError as e:
        if not _peer_gone(e):
            raise
        # another rank's process died (a killed worker, a lost node): its agent restarts the group or the launcher
        # says which node was lost; this rank's traceback would only bury that line
        print(f"runner: rank {rank} lost a peer: {str(e).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        sys.exit(PEER_GONE_EXIT)  # the launcher then asks the roll call which node it was
    except BaseException as e:
        if not is_pruned(e):
            raise
        # every rank gets the prune decision together; the launcher tells the sweeper
        if rank == 0:
            (Path(spec.run_dir) / PRUNED_FILE).write_text(str(e))


def exit_before_teardown() -> None:
    """End the finished worker as Python's exit would, but without tearing the interpreter down.

    torch keeps the device mesh, and with it the gloo process group, in caches past destroy_process_group
    (DTensor's sharding and redistribution plans, the collectives' mesh topology), so the group's threads live
    into the interpreter's teardown. One that frees its last collective's tensor there (a rank descheduled on a
    busy machine) takes the GIL of a finalizing interpreter, which ends the thread inside a noexcept frame: the
    rank aborts with "terminate called without an active exception" after a run that succeeded. Exit handlers,
    threads and streams are finished here, while the interpreter is whole; then the process ends at once."""
    for thread in threading.enumerate():  # as the interpreter's exit waits for them (the tracker's opener)
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rounds_before() -> int:
    """Rounds of the group before this one, the same on every rank: runner's launcher gives every node node 0's
    count (runner/cli/rendezvous.py). torch's restart count is each agent's own (0 on a node whose workers were
    stopped for another node's restart), so under plain torchrun the ranks take the largest."""
    if os.environ.get("RUNNER_RDZV_ROUND_INDEX"):
        return int(os.environ["RUNNER_RDZV_ROUND_INDEX"])
    return max(gather_objects(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))))


def _peer_gone(error: RuntimeError) -> bool:
    """Whether a collective failed because the process at the other end is gone (gloo's words for it)."""
    text = str(error)
    return any(words in text for words in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))


def _has_checkpoint(run_dir: str) -> bool:
    try:
        checkpoint.resolve(run_dir)
        return True
    except SpecError:
        return False


if __name__ == "__main__":
    main(sys.argv[1])
