"""trainer.profile on real runs (CPU): the window's trace, the shares logged to MLflow, and the advice
computed from what was measured (a run bound by data loading is advised more workers, one bound by
compute is not)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from runner.addons import profile_advice, profiling
from runner.engine.engine import Engine
from runner.tracking.tracker import NullTracker
from tests.conftest import REPO, compose_spec, run_cli
from tests.runner.engine.test_engine import FAST, ctrl_c_during_step
from tests.runner.engine.test_monitor import time_each_step

SEARCH = f"hydra.searchpath=[file://{REPO / 'tests' / 'user_pkg' / 'conf'}]"
# each sample sleeps 4 ms: 32 ms of waiting for a batch of 8, against well under 1 ms of compute on a tiny MLP.
# 64 samples: 8 steps an epoch, so the window (steps 7-9) goes on across the epoch's end.
DATA_BOUND = [SEARCH, "dataset=slow_samples", "model.hidden=[8]", "trainer.max_steps=9", "trainer.profile=true",
              "trainer.profile_skip_steps=6", "trainer.profile_steps=3", *FAST]
WORKERS = re.compile(r"data loading is (\d+)% of step time: "
                     r"raise dataset\.num_workers \(now 0; this machine has \d+ CPUs\)")


def report_of(run_dir: Path) -> str:
    return (run_dir / "profile" / "profile_report.txt").read_text()


class Recorded(NullTracker):
    """What the engine hands its tracker (MLflow's own store is checked in the ddp test: creating one costs seconds)."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[tuple[int, float]]] = {}
        self.artifacts: list[Path] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((step, value))

    def log_artifact(self, path: Path) -> None:
        self.artifacts.append(Path(path))


def test_a_data_bound_run_is_advised_more_workers_with_its_measured_share(tmp_path: Path) -> None:
    tracker = Recorded()
    Engine(compose_spec(DATA_BOUND, tmp_path / "run"), tracker).fit()
    report = report_of(tmp_path / "run")
    assert report.startswith("profile of 3 optimizer step(s) (steps 7-9, rank 0, cpu)")
    shown = WORKERS.search(report)
    assert shown, report
    [(step, data)] = tracker.metrics["profile/data"]
    assert step == 9 and data >= profile_advice.DATA_SHARE
    assert int(shown.group(1)) == round(data * 100)  # the advice quotes the logged measurement
    profile = tmp_path / "run" / "profile"
    assert tracker.artifacts[:2] == [profile / "profile_report.txt", profile / "profile_rank0.pt.trace.json"]
    trace = json.loads((profile / "profile_rank0.pt.trace.json").read_text())
    labels = [e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("runner/")]
    for phase in ("to_device", "forward", "backward", "optimizer"):
        assert labels.count(f"runner/{phase}") == 3, phase  # one per profiled step, and only those
    assert labels.count("runner/data") == 4  # and the fetch that found the end of the epoch


def test_a_compute_bound_run_is_not_advised_workers_and_a_short_run_is_profiled_at_its_end(tmp_path: Path) -> None:
    """digits is a tensor dataset gathered in one index per batch: its wait for data is tiny next to a
    2048-wide MLP's forward and backward (wide enough that a busy machine cannot
    tip the shares). The run's 4 steps cannot skip the default 5: the window moves to its end."""
    engine = Engine(compose_spec(["model.hidden=[2048,2048]", "dataset.batch_size=512", "trainer.max_steps=4",
                                  "trainer.profile=true", "trainer.profile_steps=3", *FAST], tmp_path / "run"))
    engine.fit()
    report = report_of(tmp_path / "run")
    fig = engine.profiler.figures
    assert fig.steps == 3 and fig.share("data") < profile_advice.DATA_SHARE
    assert fig.share("forward") + fig.share("backward") > fig.share("data")
    assert "num_workers" not in report
    assert report.startswith("profile of 3 optimizer step(s) (steps 2-4, rank 0, cpu)")
    assert "skipped the first 1 steps, not trainer.profile_skip_steps=5: the run has too few steps" in report


def test_profiling_off_puts_nothing_in_the_step_loop(tmp_path: Path) -> None:
    engine = Engine(compose_spec(FAST, tmp_path / "run"))
    assert isinstance(engine.profiler, profiling.NoProfiler)
    steps = iter([])
    assert engine.profiler.steps(steps) is steps  # the loader's own iterator, nothing wrapped around it
    phases = engine.profiler.phase
    assert all(getattr(phases, name) is getattr(profiling.OFF, name) for name in profiling.Phases.__slots__)


def test_a_run_interrupted_inside_the_window_leaves_no_profiler_running(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In a multirun the next job runs in this process: a profiler left on would record (and slow) every op of it."""
    calls = []

    class Counted(torch.profiler.profile):
        def start(self) -> None:
            calls.append("start")
            super().start()

        def stop(self) -> None:
            calls.append("stop")
            super().stop()

    monkeypatch.setattr(torch.profiler, "profile", Counted)
    engine = ctrl_c_during_step(Engine(compose_spec(DATA_BOUND, tmp_path / "run")), step=8)  # the window: steps 7-9
    with pytest.raises(KeyboardInterrupt):
        engine.fit()
    assert calls == ["start", "stop"]
    assert not (tmp_path / "run" / "profile").exists()  # no report from a run that failed


# slow (about 25 s: two workers through torchrun, and a new MLflow store). In CI, the data-bound test keeps the
# report, the trace and what the engine hands its tracker; only this checks that each rank writes its own trace,
# rank 0 alone reports, and MLflow's store holds the artifacts and the shares.
@pytest.mark.slow
def test_under_ddp_each_rank_writes_its_trace_and_the_main_rank_reports_to_mlflow(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = run_cli(["parallelism=ddp", "parallelism.nproc_per_node=2", "model.hidden=[16]", "trainer.max_steps=5",
                    "trainer.profile=true", "trainer.profile_skip_steps=2", "trainer.profile_steps=3", *FAST,
                    f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path / 'artifacts'}",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert out.count("profile of 3 optimizer step(s)") == 1 and "rank 0" in report_of(tmp_path / "run")
    assert re.search(r"  waiting for ranks +\d+%", out) and re.search(r"  communication +\d+%", out)
    for rank in (0, 1):
        trace = json.loads((tmp_path / "run" / "profile" / f"profile_rank{rank}.pt.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "runner/backward" in names and any("all_reduce" in (n or "") for n in names)
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts >= {"profile_report.txt", "profile_rank0.pt.trace.json"}
    [share] = client.get_metric_history(run.info.run_id, "profile/communication")
    assert share.step == 5 and 0 < share.value


def test_profiled_steps_and_the_profilers_own_work_are_not_throughput(tmp_path: Path, sqlite_uri: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting and stopping the profiler and each phase of a profiled step take 100 s more on the clock (on a
    GPU starting it takes seconds, its stop processes the events): the logged samples/s of each window must
    come from its unprofiled steps alone, their units and their time. Steps 7-10 are profiled; windows of 4
    steps: 1-4 (none profiled), 5-8 (7 and 8) and 9-12 (9 and 10)."""
    import time

    from tests.runner.engine.test_engine import tracked
    from tests.runner.engine.test_parallel import metric_history

    offset = {"s": 0.0}
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset["s"])

    def slow(real):
        def call(*args, **kwargs):
            offset["s"] += 100.0
            return real(*args, **kwargs)
        return call

    for name in ("_open", "_close"):
        monkeypatch.setattr(profiling.WindowProfiler, name, slow(getattr(profiling.WindowProfiler, name)))
    monkeypatch.setattr(profiling._Timed, "__enter__", slow(profiling._Timed.__enter__))
    engine = tracked(["model.hidden=[16]", "trainer.max_steps=12", "trainer.log_every_n_steps=4", "trainer.profile=true",
                      "trainer.profile_skip_steps=6", "trainer.profile_steps=4", *FAST], tmp_path / "run", sqlite_uri)
    step_seconds = time_each_step(engine, monkeypatch)
    engine.fit()
    assert engine.profiler.figures.steps == 4 and step_seconds[6] > 100  # the profiled steps really were slow
    logged = metric_history(tmp_path / "mlflow.db")["throughput/samples_per_s"]
    assert [s for s, _ in logged] == [4, 8, 12]
    timed_steps = {4: [1, 2, 3, 4], 8: [5, 6], 12: [11, 12]}
    for step, samples_per_s in logged:
        window = len(timed_steps[step]) * 64 / samples_per_s  # the seconds its timed steps took, as logged
        steps = sum(step_seconds[s - 1] for s in timed_steps[step])
        assert steps <= window < steps + 50, (step, window, steps)


def test_profiling_on_a_cpu_prints_no_kineto_lines(tmp_path: Path) -> None:
    """Before: every CPU profile printed kineto's USDT profiler_start/stop lines and "ERROR ... gpuGetDeviceCount
    failed with code 35" around runner's report; a real process, since kineto writes to the fd itself."""
    proc = run_cli(["model.hidden=[16]", "trainer.max_steps=3", "trainer.profile=true", "trainer.profile_skip_steps=1",
                    "trainer.profile_steps=2", *FAST, "tracking=none", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "profile of 2 optimizer step(s)" in out
    assert "gpuGetDeviceCount" not in out and "USDT:" not in out and "ERROR" not in out


def test_a_window_past_the_runs_end_profiles_what_there_is_and_says_so(tmp_path: Path) -> None:
    """trainer.profile_skip_steps=5 trainer.profile_steps=10 on a 4-step run (issue 26, section 2: accepted
    silently): the 4 steps are profiled, and the report says which settings it could not follow and why."""
    spec = compose_spec(["model.hidden=[8]", "trainer.max_steps=4", "trainer.profile=true", "trainer.profile_skip_steps=5",
                         "trainer.profile_steps=10", *FAST], tmp_path / "run")
    Engine(spec, NullTracker()).fit()
    report = report_of(tmp_path / "run")
    assert report.startswith("profile of 4 optimizer step(s) (steps 1-4")
    assert "(skipped the first 0 steps, not trainer.profile_skip_steps=5: the run has too few steps)" in report
    assert "(profiled 4 steps, not trainer.profile_steps=10: the run ended first)" in report


@pytest.mark.parametrize("skip, steps, said", [
    (5, 10, "trainer.profile_skip_steps=5 is past the 4 steps this run has left: profiling steps 1-4, its last, instead; "
            "lower trainer.profile_skip_steps or train longer to leave the warm-up out"),
    (2, 3, "trainer.profile_skip_steps=2 and trainer.profile_steps=3 do not both fit the 4 steps this run has left: "
           "profiling steps 2-4, its last, instead;"),
])
def test_a_window_that_does_not_fit_is_said_in_one_line_as_the_run_starts(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                          skip: int, steps: int, said: str) -> None:
    """Issue 35, item 13: a profile_skip_steps past the run's end was accepted without a word until the report at
    the run's end. The window still moves to the run's last steps (issue 26's choice, tested above); the run says
    so as it starts, before its first step."""
    spec = compose_spec(["model.hidden=[8]", "trainer.max_steps=4", "trainer.profile=true",
                         f"trainer.profile_skip_steps={skip}", f"trainer.profile_steps={steps}", *FAST], tmp_path / "run")
    with caplog.at_level("INFO"):
        Engine(spec, NullTracker()).fit()
    messages = [r.getMessage() for r in caplog.records]
    warned = [i for i, m in enumerate(messages) if m.startswith(said)]
    first_step = next(i for i, m in enumerate(messages) if m.startswith(("profile of", "epoch 0 step")))
    assert len(warned) == 1 and warned[0] < first_step, messages


def test_a_window_that_fits_says_nothing_before_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = compose_spec(["model.hidden=[8]", "trainer.max_steps=4", "trainer.profile=true", "trainer.profile_skip_steps=1",
                         "trainer.profile_steps=3", *FAST], tmp_path / "run")
    with caplog.at_level("INFO"):
        Engine(spec, NullTracker()).fit()
    assert not any("trainer.profile_skip_steps" in r.getMessage() for r in caplog.records)
