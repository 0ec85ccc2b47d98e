"""The options of each config group, read from conf/: a reader who knows the config tree knows the code tree."""
from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def groups() -> list[str]:
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


def options(group: str) -> list[str]:
    """Option names of a config group, e.g. options('precision') -> ['bf16', 'bf16_true', ...]."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
