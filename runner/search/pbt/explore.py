"""PBT's search space and its two explore rules.

The space names only keys runner/search/pbt/mutable.py allows to change mid-run, each an `interval(lo, hi)`
(`tag(log, interval(lo, hi))` for a log scale) or a numeric `choice(...)`, in Hydra's sweep grammar.
- pbt: each value is multiplied by one of `perturb` (0.8 or 1.2), or with `resample_probability` drawn
  anew from the space; kept within bounds (a choice moves to a neighbour).
- pb2: a GP bandit (Parker-Holder et al. 2020): a Gaussian process over (round, hyperparameters) ->
  the objective's improvement in that round, fitted to the population's recent rounds, proposes the
  point of highest upper confidence bound at the next round. The GP is a few lines of numpy (an RBF
  kernel whose length scale is picked by marginal likelihood from a small grid): Optuna's GP sampler
  works on a study's trials and needs torch's autograd for its fit, which is more than this asks.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from runner.search.pbt.mutable import MUTABLE, is_mutable
from runner.specs.run import SpecError


@dataclass(frozen=True)
class Dim:
    low: float
    high: float
    log: bool = False
    choices: tuple[float, ...] = ()

    def sample(self, rng: random.Random) -> float:
        if self.choices:
            return rng.choice(self.choices)
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def clip(self, value: float) -> float:
        return min(max(value, self.low), self.high)

    def to_unit(self, value: float) -> float:
        lo, hi, v = (math.log(self.low), math.log(self.high), math.log(value)) if self.log else (self.low, self.high, value)
        return 0.5 if hi == lo else (v - lo) / (hi - lo)

    def from_unit(self, u: float) -> float:
        if self.log:
            value = math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        else:
            value = self.low + u * (self.high - self.low)
        return min(self.choices, key=lambda c: abs(c - value)) if self.choices else self.clip(value)


def parse_space(params: dict[str, Any]) -> dict[str, Dim]:
    """`{key: "tag(log, interval(1e-4, 0.1))"}` -> Dims; a key PBT may not change mid-run, or a sweep it cannot
    perturb, is one line naming the key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep

    if not params:
        raise SpecError("hydra.sweeper.params: empty; name at least one hyperparameter, e.g. "
                        "optimizer.lr: tag(log, interval(1e-4, 0.1))")
    parser = OverridesParser.create()
    space = {}
    for key, text in params.items():
        if not is_mutable(key):
            raise SpecError(f"{key}: {text}: population-based training changes only hyperparameters that may change "
                            f"in the middle of a run; allowed: {', '.join(MUTABLE)}")
        try:
            # the sweep alone: Hydra's key grammar has no `*`, which an lr_multipliers glob needs
            value = parser.parse_override(f"key={text}").value()
        except Exception as e:  # Hydra's grammar error, already in words
            raise SpecError(f"{key}: {text}: not a sweep ({str(e).splitlines()[0]})") from None
        if isinstance(value, IntervalSweep):
            low, high, log = float(value.start), float(value.end), "log" in value.tags
            if not low < high or (log and low <= 0):
                raise SpecError(f"{key}: {text}: needs low < high{' and low > 0 on a log scale' if log else ''}")
            space[key] = Dim(low, high, log)
        elif isinstance(value, ChoiceSweep) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     for v in value.list):
            choices = tuple(sorted(float(v) for v in value.list))
            space[key] = Dim(choices[0], choices[-1], "log" in value.tags, choices)
        else:
            raise SpecError(f"{key}: {text}: PBT perturbs numbers; give interval(low, high), tag(log, interval(low, "
                            "high)) or a choice of numbers")
    return space


def sample(space: dict[str, Dim], rng: random.Random) -> dict[str, float]:
    return {key: dim.sample(rng) for key, dim in space.items()}


def perturb(hparams: dict[str, float], space: dict[str, Dim], rng: random.Random, factors: tuple[float, ...],
            resample_probability: float) -> dict[str, float]:
    """PBT's explore: each value resampled (with that probability) or multiplied by a random factor, in bounds."""
    out = {}
    for key, dim in space.items():
        value = hparams[key]
        if rng.random() < resample_probability:
            out[key] = dim.sample(rng)
        elif dim.choices:
            i = dim.choices.index(min(dim.choices, key=lambda c: abs(c - value)))
            step = rng.choice((-1, 1)) if any(f != 1.0 for f in factors) else 0
            out[key] = dim.choices[min(max(i + step, 0), len(dim.choices) - 1)]
        else:
            out[key] = dim.clip(value * rng.choice(factors))
    return out


def pb2_propose(space: dict[str, Dim], history: list[tuple[int, dict[str, float], float]], next_round: int,
                rng: random.Random, kappa: float = 2.0, candidates: int = 512) -> dict[str, float]:
    """PB2's explore: the UCB-best hyperparameters for `next_round` under a GP fitted to
    history = [(round, hparams, improvement in that round)]."""
    keys = list(space)
    if len(history) < 2:
        return sample(space, rng)
    rounds = max(r for r, _, _ in history) or 1
    x = np.array([[r / rounds, *(space[k].to_unit(h[k]) for k in keys)] for r, h, _ in history])
    y = np.array([d for _, _, d in history], dtype=float)
    y = (y - y.mean()) / (y.std() or 1.0)
    gp = _fit_gp(x, y)
    rs = np.random.default_rng(rng.getrandbits(32))
    unit = rs.random((candidates, len(keys)))
    query = np.column_stack([np.full(candidates, next_round / rounds), unit])
    mean, std = gp(query)
    best = unit[int(np.argmax(mean + kappa * std))]
    return {k: space[k].from_unit(float(u)) for k, u in zip(keys, best)}


def _fit_gp(x: np.ndarray, y: np.ndarray, noise: float = 1e-2):
    """An RBF-kernel GP; the length scale that maximises the marginal likelihood among a few."""
    def kernel(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
        d = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return np.exp(-0.5 * d / scale ** 2)

    best = None
    for scale in (0.1, 0.2, 0.5, 1.0, 2.0):
        k = kernel(x, x, scale) + noise * np.eye(len(x))
        chol = np.linalg.cholesky(k)
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, y))
        evidence = -0.5 * y @ alpha - np.log(np.diag(chol)).sum()
        if best is None or evidence > best[0]:
            best = (evidence, scale, chol, alpha)
    _, scale, chol, alpha = best

    def predict(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ks = kernel(q, x, scale)
        v = np.linalg.solve(chol, ks.T)
        return ks @ alpha, np.sqrt(np.clip(1.0 - (v ** 2).sum(0), 1e-12, None))

    return predict


def mlflow_key(key: str) -> str:
    """A space key as an MLflow metric or param name: a glob's `*`, `?` and `[...]` are not allowed there, so
    each becomes `_` (optimizer.lr_multipliers.backbone.* -> optimizer.lr_multipliers.backbone._)."""
    return re.sub(r"[^\w\-. :/]", "_", key)
