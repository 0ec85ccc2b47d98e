"""The precision group (conf/precision/<name>.yaml; runner/engine/precision.py acts on it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.specs.fields import opt


@dataclass(frozen=True)
class PrecisionSpec:
    name: str = opt("fp32", "numeric precision option (conf/precision/<name>.yaml)")
    init_scale: float = opt(2.0 ** 16, "fp16: initial loss scale", gt=0)
