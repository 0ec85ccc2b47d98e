"""A cache of the config Hydra composes for a single run, on disk, under the user's cache directory
($XDG_CACHE_HOME/runner/composed, else ~/.cache/runner/composed).

Composing conf/ costs a run 0.15-0.2 s of CPU before its first step (Hydra scans its plugins, then reads and
merges some twenty YAML files) and gives the same config for the same inputs. A command run again as it was
gets the config Hydra composed for it the time before. The key is a digest of everything a composition
reads: the names of the files and folders on the config search path (conf/ and a user's
`hydra.searchpath`) and the content of their YAML files, the code of every installed Hydra plugin (they
register configs and may change the search path), Hydra's own configs, the versions of Python, Hydra and
OmegaConf, the config name, the overrides as typed, the working directory, sys.path and every environment
variable. A change to any of them is another key: Hydra composes, and its config is kept under that key.

The config is kept as Hydra composed it, before anything read it: its interpolations are unresolved, so
`${now:...}` (the run directory), `${oc.env:...}` and the rest still resolve in each run. It is kept as a
pickle because that is the one form OmegaConf restores exactly (node types, the structured configs of
Hydra's node, flags); the folder is the user's own (0700) and a file another user owns is never read.

Not cached, as the key would not see all a composition reads or a run would miss what it says: a search
path known only once composed (an entry with `${...}`), an entry naming a package (`pkg://`, whose import
may register configs from code the key does not hash) or no folder, a search path a plugin extends, and a
composition that warned (each run shows its warnings).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Iterable

from hydra.core.config_loader import ConfigLoader

from runner.specs import registry

VERSION_BASE = "1.3"  # runner's, as hydra.main and preflight's composition give it
_FORMAT = b"runner composed config 1"  # changed with what an entry holds
_KEEP = 64  # entries kept; the oldest beyond these are removed when one is written
_MOST_FILES = 2000  # files hashed for one key, at most
_READ = {".yaml", ".yml", ".py"}  # the files whose content is hashed (every other file's name is)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "runner" / "composed"


def key(config_name: str, overrides: list[str], searchpath: tuple[str, ...] | None) -> str | None:
    """The digest of what composing `config_name` with these overrides reads; None where that is not all known."""
    if searchpath is None or any(not _is_folder(entry) for entry in searchpath):
        return None
    dirs = registry.search_dirs(searchpath)
    if len(dirs) != 1 + len(searchpath):  # an entry that names no folder: Hydra warns of it in each run
        return None
    import hydra
    import hydra_plugins
    import omegaconf

    digest = hashlib.sha256(_FORMAT)

    def add(*parts: object) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else repr(part).encode()
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)

    add(sys.version, hydra.__version__, omegaconf.__version__, config_name, list(overrides), os.getcwd(),
        list(sys.path), sorted(os.environ.items()))
    hydra_conf = Path(hydra.__file__).parent / "conf"
    plugin_dirs = [Path(p) for p in hydra_plugins.__path__ if Path(p).is_dir()]  # an editable install's hook is not one
    read = 0
    for root in [*dirs, hydra_conf, *plugin_dirs]:
        add(str(root))
        for path in _files(root):
            read += 1
            if read > _MOST_FILES:  # a search path over a whole project (its outputs/ included): composing is cheaper
                return None
            # Hydra reads a folder's names and its YAML files; a plugin is its code (and configs)
            add(str(path.relative_to(root)), path.read_bytes() if path.suffix in _READ else b"")
    return digest.hexdigest()


def load(digest: str | None) -> tuple[Any, Any] | None:
    """The config kept under digest and a config loader for it (made only where used), with what Hydra's
    initialization leaves behind for a composed config (its resolvers, the version base); None: not kept."""
    if digest is None:
        return None
    try:
        path = cache_dir() / f"{digest}.pickle"
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return None
            cfg = pickle.load(f)
        os.utime(path)  # kept among the most recently used
    except Exception:  # noqa: BLE001  (missing, unreadable, or written by another version: compose instead)
        return None
    from hydra import version
    from hydra.core.utils import setup_globals

    version.setbase(VERSION_BASE)
    setup_globals()  # ${now:...}, ${hydra:...}: what Hydra registers as it initializes
    return cfg, LazyConfigLoader(str(registry.CONF_DIR))


def store(digest: str | None, cfg: Any, config_loader: Any) -> None:
    """Keep cfg, just composed by config_loader, under digest, where that loader's search path is all the key
    covers. A cache that cannot be written is no cache: the run goes on."""
    if digest is None or not _search_path_covered(config_loader):
        return
    temporary = None
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = folder / f".{digest}.{os.getpid()}"
        with temporary.open("wb") as f:
            pickle.dump(cfg, f, protocol=pickle.HIGHEST_PROTOCOL)
        temporary.replace(folder / f"{digest}.pickle")  # whole or not at all, under concurrent runs too
        _prune(folder)
    except Exception:  # noqa: BLE001  (no home, a full disk, a value pickle refuses: the run goes on uncached)
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def _prune(folder: Path) -> None:
    entries = list(folder.glob("*.pickle"))
    if len(entries) <= _KEEP:
        return
    entries.sort(key=lambda p: p.stat().st_mtime)
    for path in entries[:-_KEEP]:
        path.unlink(missing_ok=True)


def _search_path_covered(config_loader: Any) -> bool:
    """Whether the loader's search path is Hydra's own configs, conf/ and the plugins' structured configs
    alone (a user's entries are added per composition, not here): a plugin that extends it (a
    SearchPathPlugin) names folders the key does not read."""
    return {(e.provider, e.path) for e in config_loader.get_search_path().get_path()} <= {
        ("hydra", "pkg://hydra.conf"), ("main", str(registry.CONF_DIR)), ("schema", "structured://")}


class LazyConfigLoader(ConfigLoader):
    """The config loader Hydra's initialization makes for conf/, made when first used: a config from the cache
    needs none to run (a single run's job gets it in its HydraContext, and a user's code that composes inside
    the job uses it), and making one scans Hydra's plugins."""

    def __init__(self, config_dir: str) -> None:
        self._config_dir = config_dir
        self._loader: ConfigLoader | None = None

    def _made(self) -> ConfigLoader:
        if self._loader is None:
            from hydra._internal.config_loader_impl import ConfigLoaderImpl
            from hydra._internal.utils import create_config_search_path

            self._loader = ConfigLoaderImpl(config_search_path=create_config_search_path(self._config_dir))
        return self._loader

    def load_configuration(self, *args: Any, **kwargs: Any) -> Any:
        return self._made().load_configuration(*args, **kwargs)

    def load_sweep_config(self, *args: Any, **kwargs: Any) -> Any:
        return self._made().load_sweep_config(*args, **kwargs)

    def get_search_path(self) -> Any:
        return self._made().get_search_path()

    def get_sources(self) -> Any:
        return self._made().get_sources()

    def list_groups(self, *args: Any, **kwargs: Any) -> Any:
        return self._made().list_groups(*args, **kwargs)

    def get_group_options(self, *args: Any, **kwargs: Any) -> Any:
        return self._made().get_group_options(*args, **kwargs)

    def compute_defaults_list(self, *args: Any, **kwargs: Any) -> Any:
        return self._made().compute_defaults_list(*args, **kwargs)


def _is_folder(entry: str) -> bool:
    scheme, sep, _ = entry.partition("://")
    return not sep or scheme == "file"


def _files(root: Path) -> Iterable[Path]:
    for folder, subfolders, names in os.walk(root, followlinks=True):
        subfolders[:] = sorted(name for name in subfolders if name != "__pycache__")
        for name in sorted(names):
            yield Path(folder) / name
