"""Python's collector during a run's start-up (runner/startup_gc.py): paused while the run starts and its one engine
builds, on for training, with the start-up's objects frozen; never frozen where an engine is built and dropped."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

from runner import startup_gc
from tests.conftest import REPO


def collector_at_first_steps(tmp_path: Path, *args: str) -> list[tuple[bool, int]]:
    """(collector on, objects frozen) at the end of each engine's first optimizer step of `python -m runner <args>`."""
    listing = tmp_path / "collector.txt"
    callback = f"trainer.callbacks=[{{_target_: tests.runner.cli.collector_at_first_step.CollectorAtFirstStep, path: '{listing}'}}]"
    # the add-on's package importable as a user's is (a fresh clone does not install tests/)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "runner", "trainer.max_steps=1", "tracking=none", callback, *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [(on == "True", int(frozen)) for on, frozen in (line.split() for line in listing.read_text().splitlines())]


def test_a_single_run_trains_with_the_collector_on_and_its_start_up_frozen(tmp_path: Path) -> None:
    [(on, frozen)] = collector_at_first_steps(tmp_path)
    assert on and frozen > 100_000  # torch's modules among them


def test_engines_built_and_dropped_are_never_frozen(tmp_path: Path) -> None:
    """k-fold trains an engine per fold in one process: none of them is kept out of the collector's sight."""
    assert collector_at_first_steps(tmp_path, "trainer.cross_validation.folds=2") == [(True, 0), (True, 0)]


def test_the_end_of_a_run_leaves_the_collector_as_it_found_it() -> None:
    assert gc.isenabled()
    startup_gc.pause()
    assert not gc.isenabled()
    startup_gc.resume(freeze=True)
    assert gc.isenabled() and gc.get_freeze_count() > 0
    startup_gc.end()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()  # a collector someone else turned off stays off: pause and end leave it to them
    try:
        startup_gc.pause()
        startup_gc.end()
        assert not gc.isenabled()
    finally:
        gc.enable()
