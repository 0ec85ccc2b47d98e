"""`trainer.test_on=best`: the test metrics come from the weights that reached the best value of
objective.metric, not from the last ones.

At each validation that improves objective.metric, the model's weights and the averaged ones (EMA/SWA:
the objective may be val/ema/acc) are written to <run_dir>/checkpoints/best-step-<N>.pt, each rank its own
shards (a sharded checkpoint folder; every rank calls it, none gathers the whole model): a runner checkpoint
of the run's weights alone, written and
read through runner/engine/run_weights.py, the one place that says which weights of a run are meant. Step checkpoints' rotation
(keep_checkpoints) never removes it. At the end the best weights are loaded for the test and the last
ones put back, so the final checkpoint still continues the run exactly. SWA's BatchNorm statistics are
recomputed for the best SWA weights, as they are for the last ones, and kept in the best file.

A resume continues from a step checkpoint, whose monitor knows the best step up to it: that step's best
file is kept until a newer checkpoint knows a newer best, so a kill between a new best and the next
checkpoint never loses the weights the resumed run calls best.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from runner.addons.base import AddOn, EngineView
from runner.engine import checkpoint, parallel, run_weights

log = logging.getLogger(__name__)


class BestWeights(AddOn):
    """Keeps the best weights on disk and tests on them (the engine calls `test`). `averages` are the run's
    (runner/addons/averaging.py): kept and tested beside the model's weights."""

    name = "best_weights"

    def __init__(self, view: EngineView, averages: Any):
        spec = view.spec
        self.view, self.averages, self.metric = view, averages, spec.objective.metric
        self.wanted = spec.trainer.test_on == "best"
        # trainer.save_checkpoints=false writes nothing, the best weights included: the last ones are tested
        self.on = self.wanted and spec.trainer.save_checkpoints
        self.directory = Path(spec.run_dir) / "checkpoints"
        self.committed: int | None = None  # the best step the newest step checkpoint knows
        self.source = ""                   # where the test metrics came from: "best@step 40", "last@step 60"

    def after_evaluation(self, metrics: dict[str, float]) -> None:
        """After a validation; every rank decides alike (the metrics were reduced across ranks)."""
        step = self.view.progress.step
        if not self.on or self.view.best_step(self.metric) != step:
            return
        self._save(step)
        if self.view.env.is_main:
            self._prune(keep={self.committed, step})
        parallel.barrier()

    def state_dict(self) -> None:
        """A step checkpoint is being saved: the best step it knows is the one a resume from it would test on
        (noted here, at the save; pruned by after_checkpoint once the checkpoint is committed, which for an
        asynchronous save is later). Nothing of this add-on goes into the checkpoint."""
        self._saving = self.view.best_step(self.metric)
        return None

    def after_checkpoint(self, path: Path) -> None:
        """A step checkpoint was committed (main rank): its best step is the one a resume would test on."""
        self.committed = getattr(self, "_saving", None)
        if self.committed is None:
            self.committed = self.view.best_step(self.metric)
        if self.on:
            self._prune(keep={self.committed})

    def load_state_dict(self, state: Any) -> None:
        """Resumed: the checkpoint's monitor (loaded before the add-ons) knows its best step."""
        self.committed = self.view.best_step(self.metric)

    def test(self) -> dict[str, float]:
        """The run's test metrics: of the best weights (the last ones are back afterwards), or of the last."""
        view, step = self.view, self.view.progress.step
        best = view.best_step(self.metric)
        self.source = f"last@step {step}"
        if best is not None and best == step and self.wanted:  # the last weights are the best ones
            self.source = f"best@step {best}"
            return _test(view)
        if not self.on:
            if self.wanted and best is not None:
                view.say(f"trainer.test_on=best: trainer.save_checkpoints=false keeps no weights of step "
                         f"{best}; testing the last weights (step {step})")
            return _test(view)
        if best is None:
            view.say(f"trainer.test_on=best: {self.metric} was never evaluated (no validation of it); "
                     "testing the last weights")
            return _test(view)
        # rank 0 verifies the folder and reads its record; every rank then reads its own shards of it
        state = parallel.broadcast_object(self._read_record(best) if view.env.is_main else None)
        if state is None:
            view.say(f"trainer.test_on=best: the weights of step {best} are not in {self.directory} "
                     "(removed, or written before runner kept them); testing the last weights")
            return _test(view)
        saved = _snapshot(view.module, self.averages)
        try:
            path = run_weights.best_file(self.directory, best)
            source = parallel.flat_full_state(state) if "model" in state else path  # a one-file best: whole tensors
            parallel.load_sharded(view.module, None, source, extra=self.averages.sharded_state(),
                                  optional=(parallel.AVERAGES,))
            self.averages.load_state_dict(checkpoint.addon_states(state).get("averages"))
            self.averages.finish()  # SWA's BatchNorm statistics for these SWA weights
            metrics = _test(view)
            if self.averages.swa is not None and self.averages.swa.count:
                # the folder then holds the SWA weights as tested: what eval, export and log_model take of it
                self._save(best)
        finally:
            _restore(view.module, saved)
        self.source = f"best@step {best}"
        return metrics

    def saved_state(self, step: int) -> dict | None:
        """The weights kept for `step` (model and averages, full tensors, read on the calling rank); None where
        unreadable."""
        return self._read(step)

    def _save(self, step: int) -> None:
        """The module's weights and the averages as the best of `step`: every rank writes its own shards."""
        view = self.view
        tensors, _ = parallel.sharded_state(view.module)
        tensors = parallel.saved_names({**tensors, **self.averages.sharded_state()}, view.module)
        record = {"spec": view.spec.to_yaml(), "progress": {"step": step}, "mlflow_run_id": view.tracker.run_id or "",
                  "averages": self.averages.state_dict()} if view.env.is_main else None
        checkpoint.Checkpointer().save(run_weights.best_file(self.directory, step), step, tensors, record,
                                       kind=checkpoint.WEIGHTS)

    def _read(self, step: int) -> dict | None:
        return self._reading(step, checkpoint.load)

    def _read_record(self, step: int) -> dict | None:
        """The best folder's record (verified), or a one-file best's whole state."""
        return self._reading(step, lambda path: checkpoint.read(path)[1])

    def _reading(self, step: int, read: Any) -> dict | None:
        path = run_weights.best_file(self.directory, step)
        try:
            return read(path)
        except Exception as e:  # missing or unreadable: the caller says so and tests the last weights
            log.warning("cannot read %s (%s)", path, (str(e).strip() or type(e).__name__).splitlines()[0])
            return None

    def _prune(self, keep: set[int | None]) -> None:
        for path in self.directory.glob("best-step-*.pt"):
            match = run_weights.BEST_FILE.fullmatch(path.name)
            if match and int(match.group(1)) not in keep:
                run_weights.remove(path)


def _test(view: EngineView) -> dict[str, float]:
    return view.evaluate("test")


def _snapshot(module: torch.nn.Module, averages: Any) -> dict:
    """This rank's own tensors (shards under fsdp) of the model and the averages: no collective to put back."""
    tensors = {name: parallel.local_tensor_of(t).detach().clone() for name, t in module.state_dict(keep_vars=True).items()}
    kept = [(a, {k: v.clone() for k, v in a.values.items()}, a.count) for a in (averages.ema, averages.swa) if a is not None]
    return {"module": tensors, "averages": kept}


@torch.no_grad()
def _restore(module: torch.nn.Module, saved: dict) -> None:
    for name, t in module.state_dict(keep_vars=True).items():
        parallel.local_tensor_of(t).copy_(saved["module"][name])
    for average, values, count in saved["averages"]:
        for k, v in values.items():
            average.values[k].copy_(v)
        average.count = count

