"""The options of each config group, read from conf/: a reader who knows the config tree knows the code tree."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# An installed wheel carries conf/ inside the package as runner/conf (pyproject.toml maps it there, so a
# wheel never installs a top-level `conf`); a checkout keeps it at the repository's top level. The
# packaged copy is looked at first: next to an installed runner, `../conf` is site-packages/conf, which
# may belong to another project.
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf" / "config.yaml").is_file() else _PACKAGE.parent / "conf"


def groups() -> list[str]:
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")


def options(group: str) -> list[str]:
    """Option names of a config group, e.g. options('precision') -> ['bf16', 'bf16_true', ...]."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
