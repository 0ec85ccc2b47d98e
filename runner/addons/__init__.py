"""Behaviour around the step loop that the engine calls through one protocol (base.py): weight averages,
best weights, the model logged to MLflow, the overfit goal, gradual unfreezing, the profiler, and a user's
own callbacks (trainer.callbacks). The engine's own watch, early stopping and stop vote implement it too."""
