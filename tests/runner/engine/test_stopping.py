"""One validation per step, whatever asks for it, and early stopping counting each once."""
import math
from pathlib import Path

from tests.runner.engine.test_engine import tracked
from tests.runner.engine.test_parallel import metric_history


def test_an_eval_interval_that_divides_the_epoch_validates_once_and_early_stopping_stops_right(
        tmp_path: Path, sqlite_uri: str) -> None:
    """20 steps an epoch, validation every 10 and at each epoch's end: steps 10, 20, 30, 40, once each.
    A repeated validation would count as no improvement and stop patience 1 at step 20."""
    engine = tracked(["trainer.max_epochs=2", "trainer.eval_every_n_steps=10", "model.hidden=[32]",
                      "trainer.early_stopping.monitor=val/loss", "trainer.early_stopping.patience=1",
                      "trainer.progress_bar=off"], tmp_path / "run", sqlite_uri)
    assert engine.steps_per_epoch == 20
    engine.fit()
    history = metric_history(tmp_path / "mlflow.db")["val/loss"]
    steps = [s for s, _ in history]
    assert len(steps) == len(set(steps))  # one value per step
    best, stop_step = math.inf, 40  # patience 1: the first validation that does not improve stops the run
    for step, value in history:
        if value >= best:
            stop_step = step
            break
        best = value
    assert engine.progress.step == stop_step == steps[-1]
    assert steps == [10, 20, 30, 40]  # val/loss improved at each: the run trained to its end
