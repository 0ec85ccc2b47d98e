"""The keys of runner's modes besides training (`mode=eval|predict|export`, conf/config.yaml's `eval` and
`predict`; runner/results/modes.py acts on them): what an evaluation evaluates and what a prediction reads
and writes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from runner.spec.fields import SpecError, opt

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


def check_mode(spec) -> None:
    """Rules across keys (RunSpec.validate): a mode other than train works on a trained run."""
    if spec.mode != "train" and not spec.trainer.resume:
        raise SpecError(f"trainer.resume: mode={spec.mode} needs a trained run; give "
                        f"trainer.resume=<run dir | checkpoint file | MLflow run id>")
