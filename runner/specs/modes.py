"""The keys of runner's modes besides training (`mode=eval|predict|export`, conf/config.yaml's `eval` and
`predict`; runner/results/modes.py acts on them): what an evaluation evaluates and what a prediction reads
and writes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from runner.specs.fields import SpecError, opt

MODES = ("train", "eval", "predict", "export")


@dataclass(frozen=True)
class EvalSpec:
    splits: tuple[Literal["val", "test"], ...] = opt(("val", "test"), "mode=eval: the splits evaluated")


@dataclass(frozen=True)
class PredictSpec:
    split: Literal["val", "test"] = opt("test", "mode=predict: the split predicted when predict.input is null")
    input: Optional[str] = opt(None, "mode=predict: a folder of images, or a text file of one input per line (a "
                                     "prompt for a language model); null: predict.split")
    format: Literal["csv", "jsonl"] = opt("csv", "mode=predict: <run_dir>/predictions.csv or predictions.jsonl")
    max_new_tokens: int = opt(32, "mode=predict, language models: tokens generated per prompt", gt=0)
    temperature: float = opt(1.0, "mode=predict, language models: sampling temperature; 0: greedy", ge=0)
    top_k: Optional[int] = opt(None, "mode=predict, language models: sample among the k likeliest tokens; null: all",
                               gt=0)


@dataclass(frozen=True)
class WeightsSpec:
    """Which weights of a trained run are meant (runner/engine/run_weights.py)."""

    which: Literal["tested", "best", "last"] = opt(
        "tested", "mode=eval|predict|export on a run directory: the weights its test metrics came from (the best "
                  "with trainer.test_on=best), its best validation's, or its last")
    average: Literal["auto", "none", "ema", "swa"] = opt(
        "auto", "the weights that leave a run (mode=predict|export, tracking.log_model): the raw ones or an average "
                "the run kept; auto: the one objective.metric measures (val/ema/acc: ema), else none")


def check_mode(spec) -> None:
    """Rules across keys (RunSpec.validate): a mode other than train works on a trained run."""
    if spec.mode != "train" and not spec.trainer.resume:
        raise SpecError(f"trainer.resume: mode={spec.mode} needs a trained run; give "
                        f"trainer.resume=<run dir | checkpoint file | MLflow run id>")
    if spec.mode == "eval" and not spec.eval.splits:
        raise SpecError("eval.splits: [] evaluates nothing; allowed: a list of val and test, e.g. [val, test] or [test]")
    if len(set(spec.eval.splits)) != len(spec.eval.splits):
        raise SpecError(f"eval.splits: {list(spec.eval.splits)} names a split twice; allowed: each of val and test once")
    if spec.mode == "train":
        check_training_weights(spec)


def check_training_weights(spec) -> None:
    """weights.* on a training run: `which` picks among a trained run's weights, so it means nothing here;
    `average` names the averaged weights that leave the run, so the run must keep them."""
    which, average = spec.weights.which, spec.weights.average
    if which != "tested":
        raise SpecError(f"weights.which: {which} picks a trained run's weights for mode=eval|predict|export, not a "
                        f"training run's; drop it (trainer.test_on=best tests the best validation's weights)")
    if average in ("ema", "swa"):
        on = spec.trainer.ema.decay is not None if average == "ema" else spec.trainer.swa.start_epoch is not None
        if not on:
            key = "trainer.ema.decay" if average == "ema" else "trainer.swa.start_epoch"
            logs = (f"tracking.log_model={spec.tracking.log_model} logs" if spec.tracking.log_model != "none"
                    else "it names")
            raise SpecError(f"weights.average: {average}: {logs} the {average.upper()} weights, but the run keeps "
                            f"none ({key} is null); set {key} or choose weights.average=none")
