"""A user's own package, outside runner: a model, two datasets, an optimizer, a schedule and a loss named
only from YAML (conf/ here, put on hydra.searchpath), written as runner's own built-ins are."""
