"""The add-on protocol (runner/addons/base.py): a checkpoint holds one entry per add-on, and a checkpoint
written before that (the add-ons' states at its top level) still resumes exactly."""
from __future__ import annotations

from pathlib import Path

import torch

from runner.engine import checkpoint
from runner.engine.engine import Engine
from tests.conftest import compose_spec

RUN = ["model.hidden=[16]", "dataset.batch_size=256", "trainer.progress_bar=off", "trainer.eval_every_epoch=false",
       "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=5",
       "trainer.ema.decay=0.9", "trainer.eval_every_n_steps=2", "trainer.early_stopping.monitor=val/loss",
       "trainer.early_stopping.patience=3", "trainer.memory_estimate=false"]


def test_one_entry_per_addon_and_an_old_layout_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    Engine(compose_spec(RUN, tmp_path / "whole")).fit()
    step_2 = checkpoint.load(tmp_path / "whole" / "checkpoints" / "step-00000002.pt")
    assert set(step_2["addons"]) == {"averages", "early_stopping"}  # the add-ons with state, by name
    assert step_2["addons"]["averages"]["ema"]["count"] == 2
    # as the engine wrote it before the add-on entries: their states at the top, under their old keys
    old = {k: v for k, v in step_2.items() if k not in ("addons", "path")}
    old.update(averages=step_2["addons"]["averages"], early_stopping=step_2["addons"]["early_stopping"],
               overfit={"recent": [], "reached_at": None}, unfreezer=None)
    path = checkpoint.save(tmp_path / "old" / "checkpoints", 2, old, keep=1)
    resumed = Engine(compose_spec([*RUN, f"trainer.resume={path}"], tmp_path / "resumed"))
    assert resumed.progress.step == 2 and resumed.averages.ema.count == 2
    resumed.fit()
    whole, again = (checkpoint.load(tmp_path / run / "checkpoints" / "last.pt") for run in ("whole", "resumed"))
    assert all(torch.equal(whole["model"][k], again["model"][k]) for k in whole["model"])
    ema, ema_again = whole["addons"]["averages"]["ema"], again["addons"]["averages"]["ema"]
    assert ema["count"] == ema_again["count"] == 4
    assert all(torch.equal(ema["values"][k], ema_again["values"][k]) for k in ema["values"])
    assert whole["addons"]["early_stopping"] == again["addons"]["early_stopping"]


def test_each_step_end_hook_runs_in_order_with_the_steps_values_and_the_stop_that_wins_is_first_stops() -> None:
    """The one hook called every step (AddOns.on_step_end): every add-on that overrides it and uses it in this run is
    called in the list's order with the step, this rank's loss sum and count, also after one of them stopped; of
    several stops a signal's wins, then a pruner's, then the first; an add-on that leaves it idle is not called."""
    from runner.addons.base import AddOn, AddOns
    from runner.addons.base import Stop

    calls = []

    class Hook(AddOn):
        def __init__(self, name: str, stop: Stop | None = None, idle: frozenset[str] = frozenset()) -> None:
            self.name, self.stop, self.idle = name, stop, idle

        def on_step_end(self, step: int, loss_sum: torch.Tensor, samples: int) -> Stop | None:
            calls.append((self.name, step, loss_sum, samples))
            return self.stop

    class Quiet(AddOn):  # no on_step_end of its own
        name = "quiet"

    plain, other, pruned, signal = Stop("plain"), Stop("other"), Stop("pruned", pruned=True), Stop("sig", signal=15)
    loss = torch.tensor(2.5)
    cases = [([Hook("a"), Quiet(), Hook("b")], None),
             ([Hook("a"), Hook("b", plain), Hook("c", other)], plain),
             ([Hook("a", plain), Hook("b", pruned), Hook("c", other)], pruned),
             ([Hook("a", pruned), Hook("b", signal), Hook("c", Stop("late", signal=1))], signal),
             ([Hook("a", signal), Hook("b", pruned)], signal)]
    for hooks, wins in cases:
        calls.clear()
        addons = AddOns([*hooks, Hook("off", plain, idle=frozenset({"on_step_end"}))], view=None)
        assert addons.on_step_end(7, loss, 64) is wins
        assert calls == [(h.name, 7, loss, 64) for h in hooks if isinstance(h, Hook)]
