"""A user's own package, outside runner: a model and two datasets named only from YAML (conf/ here, put on
hydra.searchpath), written as runner's own built-ins are."""
