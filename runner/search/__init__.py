"""Searches over runs: an Optuna trial's side of a run, population-based training, k-fold
cross-validation, and runner's hook into the sweeper (the MLflow parent run, the summary)."""
