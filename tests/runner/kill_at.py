"""`python tests/runner/kill_at.py POINT[:SIGNAL] N <runner overrides>`: runs `python -m runner` and SIGKILLs
itself at the N-th time it reaches POINT: a real kill at a chosen moment, for the fault tests.
`step:TERM 25` sends SIGTERM instead (any signal name without its SIG prefix).

POINT: step (inside an optimizer step), save (half-way through writing a checkpoint file), async_save (while
trainer.async_checkpoint's thread writes a checkpoint's shards, once the run has committed one),
final_eval (during the validation of the last step), finish_training (after the last step, before
the final evaluation), after_final_checkpoint (the final checkpoint is written, the run not ended),
run_finished (the run ended FINISHED, its summary not printed yet), fold_recorded (a k-fold run's fold is in its record, its results not yet logged to MLflow),
pbt_exploit (a PBT sweep between rounds, ranking its members: outside any member's training).
"""
import os
import runpy
import signal
import sys

from runner.engine import engine, monitor

point, _, signame = sys.argv[1].partition(":")
nth = int(sys.argv[2])
sig = getattr(signal, f"SIG{signame}") if signame else signal.SIGKILL
sys.argv = ["runner", *sys.argv[3:]]
seen = {"n": 0}


def reached() -> None:
    seen["n"] += 1
    if seen["n"] == nth:
        os.kill(os.getpid(), sig)


def wrap(owner, name, when=lambda *a, **k: True):
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        if when(*args, **kwargs):
            reached()
        return original(*args, **kwargs)

    setattr(owner, name, patched)


if point == "step":
    wrap(engine.Engine, "train_step")
elif point == "final_eval":
    wrap(engine.Engine, "evaluate", lambda self, split: split == "val" and self.progress.step == self.total_steps)
elif point == "finish_training":
    wrap(engine.Engine, "_finish_training")
elif point == "after_final_checkpoint":
    wrap(monitor.Monitor, "finish")
elif point == "run_finished":
    from runner.cli import launch

    wrap(launch, "print_summary")
elif point == "fold_recorded":
    from runner.search import cross_validation

    wrap(cross_validation, "_log_fold")
elif point == "pbt_exploit":
    from runner.search.pbt.population import Population

    wrap(Population, "_exploit_and_explore")
elif point == "save":
    import torch

    original_save = torch.save

    def half_written(obj, f, *args, **kwargs):
        seen["n"] += 1
        if seen["n"] == nth and hasattr(f, "write"):
            f.write(b"\x80\x02partial checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original_save(obj, f, *args, **kwargs)

    torch.save = half_written
elif point == "async_save":
    import threading
    from pathlib import Path

    import torch

    original_save = torch.save
    run_dir = next((Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("hydra.run.dir=")), Path("."))

    def in_background(obj, f, *args, **kwargs):
        # a shard written by trainer.async_checkpoint's thread, once the run has a committed checkpoint
        if threading.current_thread() is not threading.main_thread() and (run_dir / "checkpoints" / "last.pt").exists():
            reached()
        return original_save(obj, f, *args, **kwargs)

    torch.save = in_background
else:
    raise SystemExit(f"unknown kill point {point!r}")
runpy.run_module("runner", run_name="__main__")
