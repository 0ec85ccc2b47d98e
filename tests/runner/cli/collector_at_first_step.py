"""An add-on for tests/runner/cli/test_startup_gc.py: at the end of each engine's optimizer step 1 it appends the
state of Python's cyclic garbage collector to `path`: whether it is on, and how many objects it keeps frozen."""
from __future__ import annotations

import gc
from pathlib import Path

from runner.addons.base import AddOn


class CollectorAtFirstStep(AddOn):
    name = "collector_at_first_step"

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_step_end(self, step, loss_sum, samples) -> None:
        if step == 1:
            with self.path.open("a") as f:
                f.write(f"{gc.isenabled()} {gc.get_freeze_count()}\n")
