"""The run spec: Hydra's composed config turned into frozen, typed dataclasses, one per config group,
checked before anything runs. Imports no torch."""
