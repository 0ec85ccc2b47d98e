"""Add-ons the tests of the tracking process (test_store_process.py) run inside `python -m runner`; this module
imports no MLflow (the run's own imports are what one of them checks)."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from runner.addons.base import AddOn

MARKS = "RUNNER_TEST_MARKS"  # where the add-ons below write what they saw


class SeesMlflow(AddOn):
    """Writes, at the run's end, whether the training process imported MLflow and which tracking process it used."""

    name = "sees_mlflow"

    def on_run_end(self, final):
        from runner.tracking import store_process

        Path(os.environ[MARKS]).write_text(json.dumps({
            "mlflow_imported": "mlflow" in sys.modules,
            "children": [p.proc.pid for p in store_process._live]}))


class KillsTrackingProcess(AddOn):
    """SIGKILLs the tracking process after optimizer step 5, and records its pid."""

    name = "kills_tracking_process"

    def on_step_end(self, step, loss_sum, samples):
        if step == 5:
            from runner.tracking import store_process

            pids = [p.proc.pid for p in store_process._live]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            Path(os.environ[MARKS]).write_text(json.dumps({"killed": pids}))
        return None


