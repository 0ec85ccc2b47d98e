"""Gradual unfreezing (`model.freeze` with `model.unfreeze_after_epochs`), an add-on (runner/addons/base.py):
the parameters runner/engine/finetune.py's Unfreezer froze are unfrozen at the start of that epoch, and a
resumed run has the same parameters frozen as the run it continues."""
from __future__ import annotations

import logging
from typing import Any

from runner.addons.base import AddOn, EngineView
from runner.engine.finetune import Unfreezer

log = logging.getLogger(__name__)


class GradualUnfreezing(AddOn):
    name = "unfreezing"

    def __init__(self, unfreezer: Unfreezer, patterns: list[str]):
        self.unfreezer, self.patterns = unfreezer, patterns
        self.is_main = True

    def setup(self, view: EngineView) -> None:
        self.is_main = view.env.is_main

    def on_epoch_start(self, epoch: int) -> None:
        unfrozen = self.unfreezer.on_epoch_start(epoch)
        if unfrozen and self.is_main:
            log.info("epoch %d: unfroze %d parameter tensors (%s)", epoch, len(unfrozen), ", ".join(self.patterns))

    def state_dict(self) -> dict[str, Any]:
        return self.unfreezer.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.unfreezer.load_state_dict(state)
