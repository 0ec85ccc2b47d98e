"""The accumulation group (conf/accumulation/steps.yaml), and its shorthand `+accum=N`: the root config does
not define `accum`, so `+accum=4` works exactly as typed and the spec reads it as accumulation.steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.specs.fields import SpecError, opt


@dataclass(frozen=True)
class AccumulationSpec:
    steps: int = opt(1, "micro-batches per optimizer step (shorthand: +accum=N)", gt=0)


def check_accum_shorthand(accum: Any, cfg: dict, overrides: tuple[str, ...]) -> None:
    """`+accum=N` together with a typed accumulation.steps: only where they agree."""
    explicit = [o for o in overrides if o.lstrip("+~").startswith("accumulation.steps=")]
    if explicit:
        steps = (cfg.get("accumulation") or {}).get("steps")
        if steps != accum:
            raise SpecError(f"accum: +accum={accum} conflicts with accumulation.steps={steps}; set only one")
