"""Python's cyclic garbage collector, paused while a single run starts and its engine builds.

Starting a run allocates some 550,000 objects that live as long as the process: the modules of torch,
dynamo, Hydra and runner, and the run's config and spec. Python's collector runs every 700 allocations
and, as the survivors pile up, walks all of them again in full collections: 0.3-0.5 s of CPU before the
first step, finding almost nothing to free (12,000-20,000 objects, ~8 MB). So `python -m runner`
pauses it (`pause`) from its start; the engine's build, once the run's parts exist, freezes what the
start-up made (gc.freeze: moved out of the collector's sight, freed by reference counting as before)
and turns the collector on again (`resume(freeze=True)`): training collects as before, over what it
allocates itself. What the start-up left as cyclic garbage stays allocated until the run ends (`end`).

Only where the process builds one engine and trains it: a run that builds others first and drops them
(a finder's, k-fold's folds) must not have them frozen, so its entry turns the collector back on before
any engine exists (`resume()`), as it does for a multirun, torchrun's ranks and the modes that train
nothing. Nothing a run computes or logs depends on when the collector runs.
"""
from __future__ import annotations

import gc

_paused = False  # the collector was turned off here, and is to be turned on again here
_froze = False   # resume froze what existed then


def pause() -> None:
    """Turn the collector off until `resume` or `end` (nothing, where it is off already: that is someone else's)."""
    global _paused
    if gc.isenabled() and not _paused:
        gc.disable()
        _paused = True


def resume(freeze: bool = False) -> None:
    """Turn the collector on again, if `pause` turned it off; `freeze`: what exists now is long-lived (the start-up's
    modules, config and spec, and the one engine this process trains), kept out of every later collection."""
    global _paused, _froze
    if not _paused:
        return
    if freeze:
        gc.freeze()
        _froze = True
    _paused = False
    gc.enable()


def end() -> None:
    """The run is over: the collector on, and what `resume` froze back in its sight (a process that goes on after the
    run, a test's, collects it)."""
    global _froze
    resume()
    if _froze:
        _froze = False
        gc.unfreeze()
