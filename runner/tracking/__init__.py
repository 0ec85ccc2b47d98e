"""Tracking: the MLflow run of a run (rank 0), the store's checks, the run record, and the UI."""
