"""The run spec: Hydra's composed config turned into frozen, typed dataclasses, one module per config group
of conf/, checked before anything runs. Imports no torch.

    run.py           RunSpec, composing the groups below; SpecError (callers import both from here)
    dataset, model, task, optimizer, scheduler      the groups named by `_target_` (their callable's own keys)
    precision, parallelism, accumulation, trainer, tracking, tune, objective, trial, modes (eval, predict)
    fields.py        typed fields (`opt`), building and checking dataclasses, one-line SpecError
    metric_names.py  the step after the spec is built that needs the task: metric names, directions
    components.py    components against their callables' signatures, and built from them
    resume.py        the spec a resume runs: the saved one with the allowed overrides
"""
