"""Behaviour around the step loop that the engine calls through one protocol: weight averages, best
weights, the model logged to MLflow, the profiler, and a user's own callbacks."""
