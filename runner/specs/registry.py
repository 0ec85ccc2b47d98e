"""The options of each config group, read from conf/ and from a user's `hydra.searchpath`: a reader who
knows the config tree knows the code tree."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Iterable

_PACKAGE = Path(__file__).resolve().parents[1]  # runner/
# An installed wheel carries conf/ inside the package as runner/conf (pyproject.toml maps it there, so a
# wheel never installs a top-level `conf`); a checkout keeps it at the repository's top level. The
# packaged copy is looked at first: next to an installed runner, `../conf` is site-packages/conf, which
# may belong to another project.
CONF_DIR = _PACKAGE / "conf" if (_PACKAGE / "conf" / "config.yaml").is_file() else _PACKAGE.parent / "conf"


def search_dirs(searchpath: Iterable[str] = ()) -> list[Path]:
    """conf/, then the folders of `hydra.searchpath` entries as Hydra reads them: `file://<dir>` (or a
    bare directory) and `pkg://<package>`. An entry that names nothing readable adds nothing."""
    dirs = [CONF_DIR]
    for entry in searchpath:
        scheme, sep, where = str(entry).partition("://")
        if not sep:
            scheme, where = "file", str(entry)
        if scheme == "file":
            dirs.append(Path(where))
        elif scheme == "pkg":
            try:
                spec = importlib.util.find_spec(where.replace("/", "."))
            except (ImportError, ValueError):
                spec = None
            if spec is not None:
                dirs += [Path(p) for p in spec.submodule_search_locations or []]
    return [d for d in dirs if d.is_dir()]


def groups(searchpath: Iterable[str] = ()) -> list[str]:
    """Config groups (folders), Hydra's own excepted."""
    return sorted({p.name for d in search_dirs(searchpath) for p in d.iterdir() if p.is_dir() and p.name != "hydra"})


def options(group: str, searchpath: Iterable[str] = ()) -> list[str]:
    """Option names of a config group, e.g. options('precision') -> ['bf16', 'bf16_true', ...]; with a
    search path, the user's own options of that group as well."""
    return sorted({p.stem for d in search_dirs(searchpath) for p in (d / group).glob("*.yaml")})
