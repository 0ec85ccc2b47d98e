"""The logging window is part of a checkpoint: a resumed run logs what the uninterrupted run logs."""
import shutil
from pathlib import Path

import pytest

from tests.runner.engine.test_engine import ctrl_c_during_step, tracked
from tests.runner.engine.test_parallel import metric_history

RUN = ["trainer.max_steps=20", "trainer.log_every_n_steps=5", "trainer.checkpoint_every_n_steps=7",
       "trainer.keep_checkpoints=5", "trainer.eval_every_n_steps=10", "model.hidden=[32]", "model.dropout=0.2",
       "trainer.progress_bar=off", "trainer.eval_every_epoch=false"]


def test_a_resume_from_a_step_between_log_steps_logs_every_value_of_the_uninterrupted_run(
        tmp_path: Path, migrated_mlflow_store: Path) -> None:
    for db in ("full.db", "cut.db"):  # migrated once (tests/conftest.py): the first open of a store is not tested here
        shutil.copy(migrated_mlflow_store, tmp_path / db)
    full = tracked(RUN, tmp_path / "full", f"sqlite:///{tmp_path}/full.db")
    full.fit()
    uri = f"sqlite:///{tmp_path}/cut.db"
    # during step 15, after the checkpoint of step 14, whose window holds steps 11 to 14
    cut = ctrl_c_during_step(tracked(RUN, tmp_path / "cut", uri), 15)
    with pytest.raises(KeyboardInterrupt):
        cut.fit()
    resumed = tracked([*RUN, f"trainer.resume={tmp_path / 'cut'}"], tmp_path / "cut", uri)
    assert resumed.progress.step == 14
    resumed.fit()
    want, got = metric_history(tmp_path / "full.db"), metric_history(tmp_path / "cut.db")
    assert [s for s, _ in got["train/loss"]] == [5, 10, 15, 20]
    timing = {"throughput/samples_per_s", "throughput/tflops"}
    assert {k: v for k, v in got.items() if k not in timing} == {k: v for k, v in want.items() if k not in timing}
    assert all([s for s, _ in got[k]] == [s for s, _ in want[k]] for k in timing)
    # the window's FLOPs came back with it: the FLOPs per sample of step 15's window are every window's
    per_sample = [t / s for (_, t), (_, s) in zip(got["throughput/tflops"], got["throughput/samples_per_s"])]
    assert per_sample == pytest.approx([per_sample[0]] * 4, rel=1e-9)


@pytest.mark.slow
def test_under_ddp_each_rank_resumes_its_own_window(tmp_path: Path) -> None:
    """Two ranks, each with its own losses in the window at the checkpoint of step 7: the resumed run
    (another run's checkpoint: a new MLflow run) logs train/loss at steps 10 and 12 as the full run did."""
    from tests.conftest import run_cli

    args = ["parallelism=ddp", "parallelism.nproc_per_node=2", "dataset.batch_size=32", "trainer.max_steps=12",
            "trainer.log_every_n_steps=5", "trainer.checkpoint_every_n_steps=7", "trainer.keep_checkpoints=5",
            "trainer.eval_every_epoch=false", "model.hidden=[32]", "trainer.progress_bar=off",
            f"tracking.artifact_root={tmp_path / 'artifacts'}"]
    full = run_cli([*args, f"hydra.run.dir={tmp_path / 'full'}", f"tracking.uri=sqlite:///{tmp_path}/full.db"], tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    ckpt = tmp_path / "full" / "checkpoints" / "step-00000007.pt"
    resumed = run_cli([*args, f"hydra.run.dir={tmp_path / 'resumed'}", f"trainer.resume={ckpt}",
                       f"tracking.uri=sqlite:///{tmp_path}/resumed.db"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = metric_history(tmp_path / "full.db")["train/loss"]
    assert metric_history(tmp_path / "resumed.db")["train/loss"] == [p for p in want if p[0] > 7] and len(want) == 3
