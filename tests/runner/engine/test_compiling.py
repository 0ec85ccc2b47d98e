"""torch.compile (runner/engine/compiling.py): the modes trainer.compile takes, no recompile for a ragged last
batch, and the steps that compiled timed apart from the throughput."""
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.engine import compiling
from runner.engine.engine import Engine
from tests.conftest import compose_spec
from tests.runner.engine.test_engine import FAST


def test_each_compile_mode_is_accepted_and_reaches_torch_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    typed = {"false": False, "true": True, "default": "default", "reduce-overhead": "reduce-overhead",
             "max-autotune": "max-autotune"}
    for text, value in typed.items():
        spec = compose_spec([f"trainer.compile={text}"], tmp_path)
        assert spec.trainer.compile == value and type(spec.trainer.compile) is type(value)
    asked: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: asked.append(kw) or model)
    for mode in compiling.MODES:
        compiling.compile_model(nn.Linear(2, 2), mode, torch.device("cpu"))
    assert [kw["mode"] for kw in asked] == [None, None, "reduce-overhead", "max-autotune"]  # false: not compiled


def test_only_a_full_micro_batch_runs_compiled(tmp_path: Path) -> None:
    inner = nn.Linear(3, 2)
    compiled = torch.compile(inner)  # nothing is compiled before its first call
    spec = compose_spec(["dataset.batch_size=8"], tmp_path)
    assert compiling.for_batch(compiled, torch.zeros(8, 3), spec) is compiled
    assert compiling.for_batch(compiled, torch.zeros(5, 3), spec) is inner  # ragged: the same module, uncompiled
    assert compiling.for_batch(compiled, {"input_ids": torch.zeros(5, 4)}, spec) is inner
    assert compiling.for_batch(inner, torch.zeros(5, 3), spec) is inner  # trainer.compile=false
    fp8 = compose_spec(["dataset.batch_size=50", "precision=fp8"], tmp_path)  # padded to 64 rows
    assert [compiling.for_batch(compiled, torch.zeros(n, 3), fp8) is compiled for n in (50, 64, 48)] == [True, True, False]


# inductor generates and builds C++ for the CPU (about a minute on a busy machine): slow. The eager
# backend runs the same Dynamo tracing and shape guards, so the fast case keeps the property in CI.
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_ragged_last_batch_does_not_recompile_and_the_compiling_step_leaves_the_throughput(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """digits' 1257 training samples in batches of 512: steps 1, 2 and 4 hold 512 samples, step 3 the
    ragged 233. Every compilation moves the clock 100 s on: only step 1 may compile, and neither the
    logged samples/s of its window nor that of the ragged step's may hold those seconds."""
    monkeypatch.setattr(compiling, "BACKEND", backend)
    torch._dynamo.reset()  # graphs cached by an earlier test would hide a compilation
    offset = {"s": 0.0}
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset["s"])
    engine = Engine(compose_spec([*FAST, "trainer.compile=default", "dataset.batch_size=512", "model.hidden=[16]",
                                  "trainer.max_steps=4", "trainer.log_every_n_steps=2"], tmp_path / "run"))
    sizes, step = [], {"now": None}  # the optimizer step being trained, None between steps
    real_step = engine.train_step

    def recorded(micro_batches):
        sizes.append(sum(len(b[1]) for b in micro_batches))
        step["now"] = len(sizes)
        try:
            return real_step(micro_batches)
        finally:
            step["now"] = None

    compiled_at: list[int | None] = []

    def compiling_now(_args) -> None:
        compiled_at.append(step["now"])
        offset["s"] += 100.0

    monkeypatch.setattr(engine, "train_step", recorded)
    torch._dynamo.callback_handler.register_start_callback(compiling_now)
    try:
        result = engine.fit()
    finally:
        torch._dynamo.callback_handler.remove_start_callback(compiling_now)
    assert sizes == [512, 512, 233, 512]
    assert [s for s in compiled_at if s is not None] and {s for s in compiled_at if s is not None} == {1}
    assert engine.monitor.compile_clock.steps == [1]
    assert "in 1 step(s) that compiled (step 1); not counted in throughput" in engine.monitor.compile_clock.summary()
    history = engine.monitor.history
    assert [s for s, _ in history["compile/seconds"]] == [2, 4]
    assert all(seconds >= 100 for _, seconds in history["compile/seconds"]) and result.compile_seconds >= 100
    (_, first), (_, second) = history["throughput/samples_per_s"]
    assert 512 / first < 50 and (233 + 512) / second < 50  # timed: step 2 alone, then steps 3 and 4


def test_the_loss_compiles_beside_the_model_only_on_a_gpu_and_computes_the_tasks_loss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Language modelling's cross-entropy over bf16 logits compiled (one fused kernel on a GPU: the engine's
    GPT-2 124M step went from 33.4% to 37.4% MFU on an H200). Where it would not pay or not work (a CPU,
    trainer.compile=false, sharded logits under tp/cp/pp) the task's own eager loss stays."""
    from runner.engine import components
    monkeypatch.setattr(compiling, "BACKEND", "eager")  # the same tracing, no code generation
    spec = compose_spec(["task=language_modeling", "dataset=synthetic_tokens", "model=gpt", "trainer.compile=true"], tmp_path)
    task = components.build_task(spec.task, None)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compiling.compile_loss(task, spec, cpu) is None
    assert compiling.compile_loss(task, compose_spec(["task=language_modeling", "dataset=synthetic_tokens", "model=gpt"],
                                                     tmp_path), cuda) is None
    monkeypatch.setattr(compiling, "COMPILE_LOSS", False)
    assert compiling.compile_loss(task, spec, cuda) is None
    monkeypatch.setattr(compiling, "COMPILE_LOSS", True)
    compiled = compiling.compile_loss(task, spec, cuda)
    assert isinstance(compiled, compiling.CompiledLoss)
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, -100, 4], [5, 6, -100, -100, 7]])
    eager = task.loss_sum(logits, labels)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    fused = compiled.loss_sum(logits, labels)
    (fused_grad,) = torch.autograd.grad(fused, logits)
    assert torch.equal(fused, eager) and torch.equal(fused_grad, eager_grad)
    assert compiled.count(labels) == task.count(labels) == 7  # the rest is the task's own
