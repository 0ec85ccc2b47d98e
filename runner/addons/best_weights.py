"""`trainer.test_on=best`: the test metrics come from the weights that reached the best value of
objective.metric, not from the last ones.

At each validation that improves objective.metric, the model's weights and the averaged ones (EMA/SWA:
the objective may be val/ema/acc) are written to <run_dir>/checkpoints/best-step-<N>.pt as full tensors (a
collective under fsdp: every rank calls it): a runner checkpoint of the run's weights alone, written and
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

from runner.engine import checkpoint, parallel, run_weights

log = logging.getLogger(__name__)


class BestWeights:
    """Keeps the best weights on disk and tests on them. `engine` is the Engine (its module, averages,
    monitor, progress, evaluate)."""

    def __init__(self, spec: Any, engine: Any):
        self.engine, self.metric = engine, spec.objective.metric
        self.wanted = spec.trainer.test_on == "best"
        # trainer.save_checkpoints=false writes nothing, the best weights included: the last ones are tested
        self.on = self.wanted and spec.trainer.save_checkpoints
        self.directory = Path(spec.run_dir) / "checkpoints"
        self.committed: int | None = None  # the best step the newest step checkpoint knows
        self.source = ""                   # where the test metrics came from: "best@step 40", "last@step 60"

    def after_eval(self, step: int) -> None:
        """After a validation; every rank decides alike (the metrics were reduced across ranks)."""
        if not self.on or self.engine.monitor.best_step.get(self.metric) != step:
            return
        state = {"step": step, "model": parallel.full_model_state(self.engine.module),
                 "averages": self.engine.averages.state_dict()}  # both collectives under fsdp
        if self.engine.env.is_main:
            run_weights.save_best(self.directory, step, state["model"], state["averages"], self.engine.spec.to_yaml(),
                                  self.engine.tracker.run_id or "")
            self._prune(keep={self.committed, step})
        parallel.barrier()

    def on_checkpoint(self) -> None:
        """A step checkpoint was written (main rank): its best step is the one a resume would test on."""
        self.committed = self.engine.monitor.best_step.get(self.metric)
        if self.on:
            self._prune(keep={self.committed})

    def resumed(self) -> None:
        self.committed = self.engine.monitor.best_step.get(self.metric)

    def test(self) -> dict[str, float]:
        """The run's test metrics: of the best weights (the last ones are back afterwards), or of the last."""
        engine, step = self.engine, self.engine.progress.step
        best = engine.monitor.best_step.get(self.metric)
        self.source = f"last@step {step}"
        if best is not None and best == step and self.wanted:  # the last weights are the best ones
            self.source = f"best@step {best}"
            return _test(engine)
        if not self.on:
            if self.wanted and best is not None:
                engine.monitor.say(f"trainer.test_on=best: trainer.save_checkpoints=false keeps no weights of step "
                                   f"{best}; testing the last weights (step {step})")
            return _test(engine)
        if best is None:
            engine.monitor.say(f"trainer.test_on=best: {self.metric} was never evaluated (no validation of it); "
                               "testing the last weights")
            return _test(engine)
        state = parallel.broadcast_object(self._read(best) if engine.env.is_main else None)
        if state is None:
            engine.monitor.say(f"trainer.test_on=best: the weights of step {best} are not in {self.directory} "
                               "(removed, or written before runner kept them); testing the last weights")
            return _test(engine)
        saved = _snapshot(engine)
        try:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(engine.module, state["model"], options=StateDictOptions(full_state_dict=True))
            engine.averages.load_state_dict(state["averages"])
            engine.averages.finish()  # SWA's BatchNorm statistics for these SWA weights
            metrics = _test(engine)
            if engine.averages.swa is not None and engine.averages.swa.count:
                # the file then holds the SWA weights as tested: what eval, export and log_model take of it
                averages = engine.averages.state_dict()  # a collective under fsdp
                if engine.env.is_main:
                    run_weights.save_best(self.directory, best, state["model"], averages, engine.spec.to_yaml(),
                                          engine.tracker.run_id or "")
        finally:
            _restore(engine, saved)
        self.source = f"best@step {best}"
        return metrics

    def saved_state(self, step: int) -> dict | None:
        """The weights kept for `step` (model and averages, full tensors, read on the calling rank); None where
        unreadable."""
        return self._read(step)

    def _read(self, step: int) -> dict | None:
        path = run_weights.best_file(self.directory, step)
        try:
            return checkpoint.load(path)
        except Exception as e:  # missing or unreadable: the caller says so and tests the last weights
            log.warning("cannot read %s (%s)", path, (str(e).strip() or type(e).__name__).splitlines()[0])
            return None

    def _prune(self, keep: set[int | None]) -> None:
        for path in self.directory.glob("best-step-*.pt"):
            match = run_weights.BEST_FILE.fullmatch(path.name)
            if match and int(match.group(1)) not in keep:
                path.unlink(missing_ok=True)


def _test(engine: Any) -> dict[str, float]:
    return {**engine.evaluate("test"), **engine.averages.evaluate("test")}


def _snapshot(engine: Any) -> dict:
    """This rank's own tensors (shards under fsdp) of the model and the averages: no collective to put back."""
    module = {name: parallel.local_tensor_of(t).detach().clone()
              for name, t in engine.module.state_dict(keep_vars=True).items()}
    averages = [(a, {k: v.clone() for k, v in a.values.items()}, a.count)
                for a in (engine.averages.ema, engine.averages.swa) if a is not None]
    return {"module": module, "averages": averages}


@torch.no_grad()
def _restore(engine: Any, saved: dict) -> None:
    for name, t in engine.module.state_dict(keep_vars=True).items():
        parallel.local_tensor_of(t).copy_(saved["module"][name])
    for average, values, count in saved["averages"]:
        for k, v in values.items():
            average.values[k].copy_(v)
        average.count = count

