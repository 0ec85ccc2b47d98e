"""The weights of a trained run, decided in one place: which file (the best validation's,
checkpoints/best-step-N.pt, or the last checkpoint) and which tensors (the raw weights, or the EMA/SWA
average the run kept beside them).

Everything that takes a trained run's weights asks here: the test on the best weights
(runner/addons/best_weights.py writes and reads the best files), `mode=eval|predict|export` on a run
(runner/results/), `tracking.log_model` (runner/addons/mlflow_model.py) and PBT's exploit, which copies a
member's last training state (runner/search/pbt/population.py).

A best file is an ordinary runner checkpoint (header, checksum: runner/engine/checkpoint.py) of kind
WEIGHTS: the run's spec, the model's full weights, the averages' and the step. It evaluates, predicts and
exports like any checkpoint and starts another run through `model.weights`; it cannot continue training
(it holds no optimizer, schedule or data position).

The choice (`weights.which`, `weights.average` in conf/config.yaml):
- which: `tested` (default), the weights the run's test metrics came from (its final checkpoint's
  `test_from`: the best with trainer.test_on=best; a run that has not tested yet: the best where it keeps
  them, else the last); `best`; `last`. A checkpoint file is itself the choice: `tested` only.
- average: `auto` (default), the average objective.metric measures (val/ema/acc: ema; val/acc: none);
  `none`, `ema`, `swa`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from runner.engine import checkpoint
from runner.spec.fields import SpecError

WHICH = ("tested", "best", "last")
AVERAGES = ("auto", "none", "ema", "swa")
BEST_FILE = re.compile(r"best-step-(\d+)\.pt")


def best_file(directory: Path, step: int) -> Path:
    return Path(directory) / f"best-step-{step:08d}.pt"


def save_best(directory: Path, step: int, model: dict, averages: dict | None, spec: str, run_id: str) -> Path:
    """The best weights of `step` as a runner checkpoint of kind WEIGHTS (atomic; non-finite weights refused)."""
    state = {"spec": spec, "model": model, "averages": averages, "progress": {"step": step},
             "mlflow_run_id": run_id or ""}
    return checkpoint.write(best_file(directory, step), step, state, kind=checkpoint.WEIGHTS)


def measured_average(metric: str) -> str:
    """The average a metric measures: val/ema/acc -> ema, val/acc -> none."""
    parts = metric.split("/")
    return parts[1] if len(parts) == 3 and parts[1] in ("ema", "swa") else "none"


def chosen_average(spec: Any) -> str:
    """The average `spec.weights.average` means for this run: auto resolved by its objective."""
    average = spec.weights.average
    return measured_average(spec.objective.metric) if average == "auto" else average


@dataclass(frozen=True)
class RunWeights:
    """One set of a trained run's weights and where they came from."""

    path: Path             # the checkpoint file they were read from
    which: str             # "best" or "last" (a step checkpoint named by file: "last" of the run it ended)
    step: int
    average: str           # "none", "ema" or "swa"
    state: dict[str, Any]  # the checkpoint's state: spec, model, averages, progress, mlflow_run_id

    @property
    def source(self) -> str:
        """As the run's `test_from` tag says it ("best@step 40"), with the average where one is chosen."""
        return f"{self.which}@step {self.step}" + (f" ({self.average})" if self.average != "none" else "")

    @property
    def spec(self) -> str | None:
        return self.state.get("spec")

    @property
    def averages(self) -> dict | None:
        """The checkpoint's averages (runner/addons/averaging.py's Averages.state_dict), for an engine to evaluate."""
        return checkpoint.addon_states(self.state).get("averages")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict holding the chosen weights: the raw ones, with the average's tensors in place
        of those it averaged (cast to the model's dtypes). The average holds every parameter and persistent
        buffer once: a name it lacks is a tied parameter's second name (gpt's lm_head.weight), which takes
        the average of its twin (the name whose raw tensor equals it; a save may have copied the tie apart),
        so a load in any order agrees."""
        model = self.state["model"]
        if self.average == "none":
            return dict(model)
        values = self.averages[self.average]["values"]
        out = {}
        for name, raw in model.items():
            twin = name if name in values else next(
                (n for n in values if n in model and model[n].shape == raw.shape and torch.equal(model[n], raw)), None)
            out[name] = raw if twin is None else values[twin].to(raw.dtype)
        return out

    def load_into(self, module: torch.nn.Module) -> None:
        """The chosen weights into `module` (a bare model, the engine's module). One line where they do not fit."""
        try:
            module.load_state_dict(self.state_dict())
        except (RuntimeError, KeyError) as e:
            raise SpecError(f"trainer.resume: the weights of {self.path} do not fit this model "
                            f"({str(e).splitlines()[0]})") from None


def read(target: str | Path, which: str = "tested", average: str = "auto") -> RunWeights:
    """The weights `target` (a run directory or a checkpoint file) names, chosen by `which` and `average`
    (see the module docstring; auto follows the run's own objective). Every refusal is one line naming the key."""
    if which not in WHICH:
        raise SpecError(f"weights.which: {which!r}; choose one of {', '.join(WHICH)}")
    if average not in AVERAGES:
        raise SpecError(f"weights.average: {average!r}; choose one of {', '.join(AVERAGES)}")
    target = Path(target)
    if target.is_dir():
        path, state, chosen = _from_run_dir(target, which)
    else:
        if which != "tested":
            raise SpecError(f"weights.which: {which} chooses among a run directory's files; trainer.resume names the "
                            f"file {target} itself: drop weights.which or give the run directory")
        path = checkpoint.verify(target)
        state = checkpoint.load(path)
        chosen = "best" if BEST_FILE.fullmatch(path.name) else "last"
    spec = yaml.safe_load(state.get("spec") or "{}") or {}
    metric = (spec.get("objective") or {}).get("metric", "")
    kind = measured_average(metric) if average == "auto" else average
    if kind != "none":
        kept = (checkpoint.addon_states(state).get("averages") or {}).get(kind)
        if kept is None or not kept.get("count") and kind == "swa":
            why = "SWA had not started yet" if kept is not None else f"the run trained without trainer.{kind}"
            key = "weights.average" if average != "auto" else f"weights.average: auto follows {metric}, and"
            raise SpecError(f"{key}: {kind}: {path} holds no {kind.upper()} weights ({why}); choose "
                            f"weights.average=none")
    step = int((state.get("progress") or {}).get("step", 0))
    return RunWeights(path, chosen, step, kind, state)


def last_training_state(run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """A run directory's newest good training checkpoint (what a resume, or PBT's exploit, continues from)."""
    return checkpoint.load_latest_good(run_dir)


def _from_run_dir(run_dir: Path, which: str) -> tuple[Path, dict[str, Any], str]:
    path, last = last_training_state(run_dir)
    if which == "last":
        return path, last, "last"
    spec = yaml.safe_load(last.get("spec") or "{}") or {}
    tested, _, tested_step = (last.get("test_from") or "").partition("@step ")
    if which == "tested" and tested == "last":
        return path, last, "last"
    metric = (spec.get("objective") or {}).get("metric", "")
    if which == "tested" and tested == "best":
        step = int(tested_step)
    else:  # which=best, or a run that has not tested yet
        step = (last.get("monitor") or {}).get("best_step", {}).get(metric)
        keeps_best = (spec.get("trainer") or {}).get("test_on", "best") == "best"
        if which == "tested" and (step is None or not keeps_best or not best_file(path.parent, step).is_file()
                                  and step != int(last["progress"]["step"])):
            return path, last, "last"
    if step is None:
        raise SpecError(f"weights.which: best: {run_dir} never validated {metric or 'its objective'}, so it has no "
                        f"best weights; use weights.which=last")
    if int(last["progress"]["step"]) == step:  # the last weights are the best ones (and SWA's statistics final)
        return path, last, "best"
    file = best_file(path.parent, step)
    if file.is_file():
        return file, checkpoint.load(file), "best"
    raise SpecError(f"weights.which: best: {run_dir} keeps no weights of its best step {step} (trainer.test_on=last "
                    f"or trainer.save_checkpoints=false); use weights.which=last")
