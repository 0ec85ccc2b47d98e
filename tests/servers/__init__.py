"""Real servers the tests start and stop: PostgreSQL (postgres.py), `mlflow server` (mlflow.py) and a
one-host SLURM cluster (slurm.py). Each helper skips the calling test with a one-line reason where its
server cannot start on this machine; none is a mock."""
