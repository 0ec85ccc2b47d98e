"""An add-on for tests/runner/cli/test_startup_imports.py: at the end of optimizer step 1 (on the main rank) it
writes the names of the modules the process has imported so far to `path`, one a line."""
from __future__ import annotations

import sys
from pathlib import Path

from runner.addons.base import AddOn


class ModulesAtFirstStep(AddOn):
    name = "modules_at_first_step"

    def __init__(self, path: str) -> None:
        self.path = path

    def on_step_end(self, step, loss_sum, samples) -> None:
        if step == 1:
            Path(self.path).write_text("\n".join(sorted(sys.modules)))
