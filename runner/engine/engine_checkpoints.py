"""The engine's checkpoints: what a checkpoint holds (everything needed to continue as if never
stopped), and how a run reads one back. A part of Engine kept in its own module (engine.py would pass
400 lines); it reads the engine's parts by their attribute names."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from runner.engine import checkpoint, parallel
from runner.search.pbt import mutable
from runner.spec.resume import starts_over
from runner.spec.run import SpecError

log = logging.getLogger("runner.engine.engine")


@dataclass
class Progress:
    """Where the run is: saved in checkpoints as the data position."""

    step: int = 0              # optimizer steps taken
    epoch: int = 0
    samples_in_epoch: int = 0  # samples of this epoch already trained on, all ranks together
    last_eval_step: int = -1   # one evaluation per step, whatever asks for it


class EngineCheckpoints:
    """Mixed into Engine: save_checkpoint, and reading and loading one at the start of a run."""

    def save_checkpoint(self) -> Path | None:
        if not self.spec.trainer.save_checkpoints:  # debug=fast: nothing to resume from is wanted
            return None
        self.watch.check(parallel.all_reduce_max)  # a checkpoint never holds diverged weights
        model_state, optim_state = parallel.full_state(self.module, self.optimizer)  # a collective: every rank
        rng = parallel.gather_objects(checkpoint.rng_state())  # each rank's own streams
        log_windows = parallel.gather_objects(self.monitor.window.state_dict())  # each rank's own losses
        averages = self.averages.state_dict()  # full tensors: a collective under fsdp
        if not self.env.is_main:
            parallel.barrier()
            return None
        # metrics up to this step are stored before the checkpoint exists: a kill after it loses none
        self.tracker.flush()
        state = {
            "spec": self.spec.to_yaml(),
            "model": model_state,
            "optimizer": optim_state,
            "schedule": self.schedule.state_dict(),
            "precision": self.precision.state_dict(),
            "rng": rng,
            "progress": vars(self.progress).copy(),
            "monitor": self.monitor.state_dict(),
            "log_windows": log_windows,
            "early_stopping": self.stopping.state_dict(),
            "overfit": self.overfit.state_dict(),
            "averages": averages,
            "finished": self.finished,
            "unfreezer": self.unfreezer.state_dict() if self.unfreezer is not None else None,
            "final": self.final,
            "test_from": self.best_weights.source,
            "mlflow_run_id": self.tracker.run_id or "",
        }
        path = checkpoint.save(Path(self.spec.run_dir) / "checkpoints", self.progress.step, state,
                               self.spec.trainer.keep_checkpoints)
        self.best_weights.on_checkpoint()
        parallel.barrier()
        return path

    def pause(self) -> None:
        """trainer.stop_at_step: validated at this step (population-based training ranks members by it) and
        checkpointed; neither tested nor finished, so a resume trains on along the same schedule."""
        self._evaluate_and_watch()
        self.save_checkpoint()
        self.tracker.set_tags({"runner.outcome": "paused", "runner.paused_at_step": str(self.progress.step)})

    def _read_checkpoint(self, where: str) -> dict | None:
        """Rank 0 reads the file (other nodes may not see its disk) and hands it to every rank (None: starting over)."""
        state = None
        if self.env.is_main and not starts_over(Path(where)):
            path, state = checkpoint.load_latest_good(where) if Path(where).is_dir() else (Path(where), checkpoint.load(where))
            state["path"] = str(path)
        return parallel.broadcast_object(state)

    def _load_state(self, state: dict) -> None:
        fresh = mutable.snapshot(self.optimizer)  # the hyperparameters this run's spec gives, before the load
        try:
            parallel.load_full_state(self.module, self.optimizer, state["model"], state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise SpecError(f"trainer.resume: the checkpoint does not fit this run's model/optimizer ({str(e).splitlines()[0]})") from None
        self.schedule.load_state_dict(state["schedule"])
        mutable.apply_changed(state.get("spec"), self.spec, self.optimizer, self.schedule, fresh)  # PBT's explore
        self.averages.load_state_dict(state.get("averages"))
        self.precision.load_state_dict(state["precision"])
        rng = state["rng"]
        checkpoint.set_rng_state(rng[self.env.rank] if len(rng) == self.env.world else rng[0])
        self.progress = Progress(**state["progress"])
        if self.unfreezer is not None and state.get("unfreezer"):
            self.unfreezer.load_state_dict(state["unfreezer"])
        self.monitor.load_state_dict(state["monitor"], step=self.progress.step)
        self.monitor.window.load_state_dict(state.get("log_windows", []), self.env.rank, self.env.world, self.device)
        self.stopping.load_state_dict(state.get("early_stopping") or state["monitor"])
        self.overfit.load_state_dict(state.get("overfit"))
        # Extended (a larger trainer.max_steps/max_epochs): a finished run trains on and ends again.
        self.finished = bool(state.get("finished")) and (self.progress.step >= self.total_steps or self.stopping.stopped_early)
        self.final = dict(state.get("final") or {})
        self.best_weights.source = state.get("test_from", "")
        self.best_weights.resumed()
        source_run = state.get("mlflow_run_id") or ""
        if _inside(Path(state["path"]), Path(self.spec.run_dir)):
            self.resume_run_id = source_run or None  # continuing this run directory: reattach to its run
        else:  # another run's checkpoint starts a new run, which names where it came from
            self.resumed_from = {"runner.resumed_from_checkpoint": state["path"]}
            if source_run:
                self.resumed_from["runner.resumed_from_run"] = source_run
        log.info("resuming at step %d (epoch %d, sample %d of the epoch) from %s", self.progress.step,
                 self.progress.epoch, self.progress.samples_in_epoch, state["path"])


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())
