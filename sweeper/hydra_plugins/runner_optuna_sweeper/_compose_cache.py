"""Composing a trial's config once per set of config group choices, not once per trial.

Hydra composes every job from scratch: it walks the defaults list, loads and merges each config
file, then applies the job's value overrides (`lr=0.01`). For runner's config that is about 0.3 s a
trial, paid in the process that launches it. The trials of a study differ in values, rarely in
groups, so the composed config before the value overrides is the same for all trials that pick the
same groups: it is composed once, and each trial gets a copy with its own value overrides applied
(as Hydra applies them: same parser, same struct rules, then the same `hydra.overrides.task` and
`hydra.job.override_dirname`).

Where a value override might name a group after all (one from a search path added by an override,
which the cache does not search: see `_doubtful`), the first trial of the group set is composed both
ways and the two compared; where they differ, or the cached way fails, that group set is composed by
Hydra every time, as before.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Optional, Sequence

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf, open_dict


class CachingConfigLoader:
    """Stands in for Hydra's config loader; everything but `load_sweep_config` goes to the real one."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.bases: dict[tuple[str, ...], Optional[DictConfig]] = {}  # None: compose this group set by Hydra
        self.lock = threading.Lock()
        self.composed = 0  # full compositions (for tests and the benchmark)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __getstate__(self) -> dict:  # a process it is sent to builds its own cache
        return {"loader": self.loader}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["loader"])

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        # the sweep's own hydra overrides (the command line's) are part of every composition, base included
        hydra_overrides = list(OmegaConf.to_container(master_config.hydra.overrides.hydra))
        parser = OverridesParser.create()
        parsed = parser.parse_overrides(hydra_overrides) + parser.parse_overrides(list(sweep_overrides))
        values = [o for o in parsed[len(hydra_overrides):] if self._is_value(o)]
        key = tuple(o.input_line for o in parsed if o not in values) + tuple("=" + o.key_or_group for o in values)
        with self.lock:
            known = key in self.bases
            base = self.bases.get(key)
        if known and base is None:
            return self._compose(master_config, sweep_overrides)
        if not known:
            groups_only = [o.input_line for o in parsed[len(hydra_overrides):] if o not in values]
            try:
                base = self._compose(master_config, groups_only)
                cfg = self._apply(base, parsed, values)
            except Exception:  # noqa: BLE001 - e.g. a group the cache took for a value: Hydra says what is wrong
                base = cfg = None
            if cfg is not None and self._doubtful(base, values):  # check against Hydra once per group set
                full = self._compose(master_config, sweep_overrides)
                if OmegaConf.to_container(full, resolve=False) != OmegaConf.to_container(cfg, resolve=False):
                    base = None
            with self.lock:
                self.bases[key] = base
            if base is None:
                return self._compose(master_config, sweep_overrides)
        else:
            cfg = self._apply(base, parsed, values)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        return cfg

    @staticmethod
    def _doubtful(base: DictConfig, values: list[Override]) -> bool:
        """Whether a value override might be a group Hydra finds where the cache does not look (a
        search path added by an override): a group in the composed defaults list, or one added with
        + or ++ (which a value can be too). Otherwise the cached composition is Hydra's."""
        groups = base.hydra.runtime.choices
        return any(o.is_add() or o.is_force_add() or o.key_or_group in groups for o in values)

    def _compose(self, master_config: DictConfig, overrides: Sequence[str]) -> DictConfig:
        self.composed += 1
        return self.loader.load_sweep_config(master_config, list(overrides))

    def _is_value(self, o: Override) -> bool:
        """A value override (`key=v`, `+key=v`, `++key=v`) of a key that names no config group:
        what Hydra applies after composing. Deletions and groups change the defaults list."""
        if o.is_delete() or o.is_sweep_override() or o.package is not None or isinstance(o.value(), dict):
            return False
        return not self.loader.repository.group_exists(o.key_or_group)

    @staticmethod
    def _apply(base: DictConfig, parsed: list[Override], values: list[Override]) -> DictConfig:
        cfg = copy.deepcopy(base)
        # Hydra's own step (a static method of its loader), so +, ++ and struct errors read as Hydra's
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        app = [o for o in parsed if not o.is_hydra_override()]
        with open_dict(cfg.hydra):
            cfg.hydra.overrides.task = [o.input_line for o in app]
            cfg.hydra.overrides.hydra = [o.input_line for o in parsed if o.is_hydra_override()]
            conf = cfg.hydra.job.config.override_dirname
            cfg.hydra.job.override_dirname = get_overrides_dirname(
                overrides=app, kv_sep=conf.kv_sep, item_sep=conf.item_sep, exclude_keys=conf.exclude_keys)
        return cfg


def install(launcher: Any) -> Optional[CachingConfigLoader]:
    """Make the launcher compose through the cache (launchers that compose through their
    hydra_context's config loader, as Hydra's basic launcher does); returns the cache or None."""
    context = getattr(launcher, "hydra_context", None)
    if context is None or not isinstance(getattr(context, "config_loader", None), ConfigLoaderImpl):
        return None
    cache = CachingConfigLoader(context.config_loader)
    launcher.hydra_context = dataclasses.replace(context, config_loader=cache)
    return cache

