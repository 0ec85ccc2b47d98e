"""Which study a sweep runs, and the seed of its sampler.

- `storage: null`: a new study for this sweep, kept in a journal file in the sweep directory
  (hydra-optuna-sweeper keeps it in memory; a file costs nothing and lets the study be resumed by
  naming it: hydra.sweeper.storage=<sweep dir>/optuna.journal).
- A named storage: the study named study_name is created, or resumed (joined, when another sweep
  process runs it now). A resume must search the same space in the same directions: the study
  remembers its search space (user attr SPACE_ATTR) and its directions, and a difference stops the
  sweep with one line naming it, before any trial starts.
- The sampler's seed: the process that created the study uses the configured seed itself (a sweep
  is reproducible); a process that resumes or joins a study adds a random per-process number to it,
  so sweep processes sharing a study never propose the same sequence of trials.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import optuna
from optuna.distributions import BaseDistribution, distribution_to_json, json_to_distribution
from optuna.storages import BaseStorage

from ._search_space import describe
from .hook import SweepConfigError
from .storage import check_storage, open_storage, storage_url

SPACE_ATTR = "runner.search_space"  # study user attr: {param: distribution JSON} of hydra.sweeper.params
JOURNAL = "optuna.journal"


@dataclass
class OpenedStudy:
    study: optuna.Study
    storage: BaseStorage
    storage_url: str
    created: bool  # False: resumed or joined, an existing study


def open_study(storage: Optional[str], study_name: Optional[str], sweep_dir: Path, directions: list[str],
               space: dict[str, BaseDistribution], pruner: optuna.pruners.BasePruner) -> OpenedStudy:
    if storage is None or str(storage).strip() in ("", "null", "None"):
        url = storage_url(sweep_dir / JOURNAL)
        backend = open_storage(url)
        earlier = backend.get_all_studies()
        if earlier:
            raise SweepConfigError(f"hydra.sweeper.storage: null starts a new study, but this sweep directory ({sweep_dir}) already "
                            f"holds study {earlier[0].study_name!r} of an earlier sweep; to resume it set "
                            f"hydra.sweeper.storage={url}, else give the sweep a new hydra.sweep.dir")
    else:
        url = storage_url(storage)
        check_storage(url)
        backend = open_storage(url)
    try:
        study = optuna.create_study(study_name=study_name, storage=backend, directions=directions, pruner=pruner)
        study.set_user_attr(SPACE_ATTR, _to_json(space))
        return OpenedStudy(study, backend, url, created=True)
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=study_name, storage=backend, pruner=pruner)
    check_resumable(study, url, directions, space)
    return OpenedStudy(study, backend, url, created=False)


def check_resumable(study: optuna.Study, url: str, directions: list[str], space: dict[str, BaseDistribution]) -> None:
    """One line naming how this sweep differs from the stored study, if it does."""
    where = f"study {study.study_name!r} in {url}"
    stored_directions = [d.name.lower() for d in study.directions]
    if stored_directions != [d.lower() for d in directions]:
        raise SweepConfigError(f"hydra.sweeper.direction: {where} was created to {', '.join(stored_directions)}, this sweep "
                        f"asks to {', '.join(d.lower() for d in directions)}; resume it with its own direction, or "
                        "start a new study (another study_name)")
    stored = study.user_attrs.get(SPACE_ATTR)
    if stored is None:  # a study made elsewhere: what its trials searched is all there is to go by
        if not study.get_trials(deepcopy=False):
            study.set_user_attr(SPACE_ATTR, _to_json(space))
        return
    before = {k: json_to_distribution(v) for k, v in stored.items()}
    changes = [f"{k} is new" for k in space if k not in before]
    changes += [f"{k} is gone (was {describe(before[k])})" for k in before if k not in space]
    changes += [f"{k} was {describe(before[k])}, is now {describe(space[k])}"
                for k in space if k in before and before[k] != space[k]]
    if changes:
        raise SweepConfigError(f"hydra.sweeper.params: the search space differs from {where}: {'; '.join(changes)}; resume it "
                        "with its own search space, or start a new study (another study_name)")


def seed_for(configured: Optional[int], created: bool) -> tuple[Optional[int], str]:
    """The sampler's seed and a note saying where it came from."""
    if configured is None:
        return None, "unseeded"
    if created:
        return configured, f"seed {configured}"
    extra = int.from_bytes(os.urandom(3), "little")
    return configured + extra, f"seed {configured} + {extra} for this process, as it joined an existing study"


def _to_json(space: dict[str, BaseDistribution]) -> dict[str, str]:
    return {k: distribution_to_json(d) for k, d in space.items()}
