"""The weights of a trained run, decided in one place: which file (the best validation's,
checkpoints/best-step-N.pt, or the last checkpoint) and which tensors (the raw weights, or the EMA/SWA
average the run kept beside them).

Everything that takes a trained run's weights asks here: the test on the best weights
(runner/addons/best_weights.py writes and reads the best files), `mode=eval|predict|export` on a run
(runner/results/), `tracking.log_model` (runner/addons/mlflow_model.py) and PBT's exploit, which copies a
member's last training state (runner/search/pbt/population.py).

A best file is an ordinary runner checkpoint (a sharded folder with its manifest: runner/engine/checkpoint.py)
of kind WEIGHTS: the run's spec, the model's weights, the averages' and the step. It evaluates, predicts and
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

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from runner.engine import checkpoint
from runner.specs.fields import SpecError

WHICH = ("tested", "best", "last")
AVERAGES = ("auto", "none", "ema", "swa")
BEST_FILE = re.compile(r"best-step-(\d+)\.pt")


def best_file(directory: Path, step: int) -> Path:
    return Path(directory) / f"best-step-{step:08d}.pt"


def remove(path: Path) -> None:
    """A kept best checkpoint removed (a sharded folder, or a one-file checkpoint of an older run)."""
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
        if "model" not in self.state:  # a sharded folder: read whole here, once
            return dataclasses.replace(self, state=checkpoint.load_weights(self.path)).state_dict()
        return self._chosen_state()

    def _chosen_state(self) -> dict[str, torch.Tensor]:
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
        """The chosen weights into `module` (a bare model in one process), whatever mesh wrote them. One line where
        they do not fit."""
        try:
            if "model" in self.state:
                module.load_state_dict(self.state_dict())
            else:
                self._stream_into(module)
        except (RuntimeError, KeyError, ValueError) as e:
            reason = e.args[0] if isinstance(e, KeyError) and e.args else str(e)  # a KeyError's str is quoted
            raise SpecError(f"trainer.resume: the weights of {self.path} do not fit this model "
                            f"({str(reason).splitlines()[0]})") from None


    @torch.no_grad()
    def _stream_into(self, module: torch.nn.Module) -> None:
        """A sharded folder's chosen weights into `module` one tensor at a time (DCP, this process alone): the
        module's own tensors are the only whole copy. A name the average lacks (a tied parameter's second name)
        takes its twin's average."""
        own = module.state_dict()
        saved = checkpoint.tensor_keys(self.path)
        missing = [k for k in own if checkpoint.MODEL + k not in saved]
        if missing:
            raise KeyError(f"the checkpoint has no {missing[0]}")
        twins = {n: names for names in _tied(module) for n in names}
        prefix = f"{checkpoint.AVERAGES}{self.average}/"
        for name, target in own.items():
            key = checkpoint.MODEL + name
            if self.average != "none":
                averaged = next((prefix + n for n in [name, *twins.get(name, ())] if prefix + n in saved), None)
                key = averaged or key
            value = checkpoint.read_tensors(self.path, [key])[key]
            if value.shape != target.shape:
                raise ValueError(f"size mismatch for {name}: the checkpoint's {tuple(value.shape)}, this model's "
                                 f"{tuple(target.shape)}")
            target.copy_(value)


def _tied(module: torch.nn.Module) -> list[list[str]]:
    shared: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    return [names for names in shared.values() if len(names) > 1]


def read(target: str | Path, which: str = "tested", average: str = "auto") -> RunWeights:
    """The weights `target` (a run directory or a checkpoint file) names, chosen by `which` and `average`
    (see the module docstring; auto follows the run's own objective). Every refusal is one line naming the key."""
    if which not in WHICH:
        raise SpecError(f"weights.which: {which!r}; choose one of {', '.join(WHICH)}")
    if average not in AVERAGES:
        raise SpecError(f"weights.average: {average!r}; choose one of {', '.join(AVERAGES)}")
    target = Path(target)
    if target.is_dir() and not checkpoint.is_folder(target):
        path, state, chosen = _from_run_dir(target, which)
    else:
        if which != "tested":
            raise SpecError(f"weights.which: {which} chooses among a run directory's files; trainer.resume names the "
                            f"file {target} itself: drop weights.which or give the run directory")
        path, state = checkpoint.read(target)  # verified; a sharded folder's record (its tensors are read as needed)
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


def _from_run_dir(run_dir: Path, which: str) -> tuple[Path, dict[str, Any], str]:
    path, last = checkpoint.read(run_dir)  # the newest good one's record: which weights it names
    if which == "last":
        return path, last, "last"
    return _chosen(run_dir, which, path, last)


def _chosen(run_dir: Path, which: str, path: Path, last: dict[str, Any]) -> tuple[Path, dict[str, Any], str]:
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
        if which == "tested" and (step is None or not keeps_best or not best_file(path.parent, step).exists()
                                  and step != int(last["progress"]["step"])):
            return path, last, "last"
    if step is None:
        raise SpecError(f"weights.which: best: {run_dir} never validated {metric or 'its objective'}, so it has no "
                        f"best weights; use weights.which=last")
    if int(last["progress"]["step"]) == step:  # the last weights are the best ones (and SWA's statistics final)
        return path, last, "best"
    file = best_file(path.parent, step)
    if file.exists():
        return file, checkpoint.read(file)[1], "best"
    raise SpecError(f"weights.which: best: {run_dir} keeps no weights of its best step {step} (trainer.test_on=last "
                    f"or trainer.save_checkpoints=false); use weights.which=last")
