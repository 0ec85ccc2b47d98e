"""The engine and the parts of its step loop: data loading, precision, parallelism, optimizer and
schedule, checkpoints, compilation, activation checkpointing, monitoring, stopping."""
